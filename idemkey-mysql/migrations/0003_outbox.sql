-- The transactional outbox (docs/guide/outbox.md): the columns and meaning of the PostgreSQL
-- store's idemkey_outbox and idemkey_outbox_audit. Messages are written in the transaction
-- of the effect they announce and delivered at least once by a relay. `id` is stable across
-- redeliveries; `grp` is the operation that wrote the message (delivered in `seq` order);
-- `data` is the payload's JSON text, kept byte for byte. Times are milliseconds since the
-- Unix epoch, like the records'.
--
-- The texts a statement compares (id, grp, claimed_by) are utf8mb4_bin, compared by their
-- bytes and never folded by case; their lengths keep the indexes within InnoDB's limit, and a
-- longer value is refused (strict mode), never cut. No index holds a column the claim writes
-- (claimed_by, claimed_until, attempts), so a claim changes its rows and nothing else.
CREATE TABLE idemkey_outbox (
    seq             BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    id              VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    grp             VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    kind            TEXT         CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    data            LONGTEXT     CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    created_at      BIGINT       NOT NULL,
    state           VARCHAR(16)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL DEFAULT 'pending',
    attempts        BIGINT       NOT NULL DEFAULT 0,
    next_attempt_at BIGINT       NOT NULL,
    claimed_by      VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    claimed_until   BIGINT,
    last_error      TEXT         CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    sent_at         BIGINT,
    CONSTRAINT idemkey_outbox_state CHECK (state IN ('pending', 'sent', 'dead')),
    UNIQUE KEY idemkey_outbox_id (id),
    -- The claim's due messages, and the stats' pending ones.
    KEY idemkey_outbox_due (state, next_attempt_at),
    -- A group's earlier pending message.
    KEY idemkey_outbox_group (grp, state, seq),
    -- The purge's sent messages.
    KEY idemkey_outbox_sent (state, sent_at)
) ENGINE = InnoDB;

-- Operators' actions on messages (`idemkey outbox retry|drop`).
CREATE TABLE idemkey_outbox_audit (
    seq        BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    message_id VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    at         BIGINT       NOT NULL,
    actor      TEXT         CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    action     TEXT         CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    detail     TEXT         CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    KEY idemkey_outbox_audit_message (message_id, seq)
) ENGINE = InnoDB;
