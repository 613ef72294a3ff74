-- One row per (tenant, key, route): the columns and meaning of the PostgreSQL store's
-- idemkey_records. The raw key is never stored: key_hash is HMAC-SHA256(secret, tenant,
-- key). Times are milliseconds since the Unix epoch.
--
-- tenant and route are bytes (VARBINARY, the UTF-8 of the text), not VARCHAR: an identity
-- is compared byte for byte. Every text collation either folds case (`_ci`) or, like
-- MariaDB's `utf8mb4_bin`, ignores trailing spaces (PAD SPACE), and the primary key would
-- then take 'POST /v1/payments' and 'POST /v1/payments ' for one route (the key hash
-- covers the tenant, not the route). Their lengths keep the primary key within InnoDB's
-- 3072-byte limit; a longer value is refused (strict mode), never cut.
-- response_body is LONGBLOB; a row travels in one packet, so a stored response must also
-- fit the server's max_allowed_packet (docs/records.md, "MySQL and MariaDB").
CREATE TABLE idemkey_records (
    tenant              VARBINARY(255)  NOT NULL,
    key_hash            BINARY(32)      NOT NULL,
    route               VARBINARY(2048) NOT NULL,
    fingerprint         BINARY(32)      NOT NULL,
    fingerprint_parts   VARBINARY(255)  NOT NULL,
    state               VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    token               BIGINT          NOT NULL,
    lease_expires_at    BIGINT,
    response_status     INT,
    response_headers    MEDIUMBLOB,
    response_body       LONGBLOB,
    created_at          BIGINT          NOT NULL,
    updated_at          BIGINT          NOT NULL,
    expires_at          BIGINT          NOT NULL,
    -- External mode: the raw key, sealed (see the PostgreSQL store's migration 0002).
    sealed_key          BLOB,
    -- Per-value digests of a JSON body, so a 422 can name the member that differs.
    fingerprint_members BLOB,
    -- The first attempt's time the claiming request stated (Repeatability-First-Sent).
    first_sent          BIGINT,
    -- The claim's uniqueness, and the status resource's (tenant, key_hash) prefix look-up.
    PRIMARY KEY (tenant, key_hash, route),
    -- Purge finds expired rows without scanning the table.
    KEY idemkey_records_expires_at (expires_at)
) ENGINE = InnoDB;
