-- The transactional outbox (docs/outbox.md): messages written in the transaction of the
-- effect they announce, delivered at least once by a relay. `id` is stable across
-- redeliveries; `grp` is the operation that wrote the message (delivered in `seq` order);
-- `data` is the payload's JSON text, kept byte for byte. Times are milliseconds since the
-- epoch, like the records'.
CREATE TABLE idemkey_outbox (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    grp TEXT NOT NULL,
    kind TEXT NOT NULL,
    data TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'sent', 'dead')),
    attempts BIGINT NOT NULL DEFAULT 0,
    next_attempt_at BIGINT NOT NULL,
    claimed_by TEXT,
    claimed_until BIGINT,
    last_error TEXT,
    sent_at BIGINT
);
CREATE INDEX idemkey_outbox_due ON idemkey_outbox (next_attempt_at) WHERE state = 'pending';
CREATE INDEX idemkey_outbox_group ON idemkey_outbox (grp, seq) WHERE state = 'pending';
CREATE INDEX idemkey_outbox_sent ON idemkey_outbox (sent_at) WHERE state = 'sent';

-- Operators' actions on messages (`idemkey outbox retry|drop`).
CREATE TABLE idemkey_outbox_audit (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id TEXT NOT NULL,
    at BIGINT NOT NULL,
    actor TEXT NOT NULL,
    action TEXT NOT NULL,
    detail TEXT NOT NULL
);
CREATE INDEX idemkey_outbox_audit_message ON idemkey_outbox_audit (message_id, seq);
