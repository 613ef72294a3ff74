-- External mode (idemkey gateway): the raw key, sealed with an AEAD keyed from the key
-- secret (12-byte nonce followed by the ciphertext and its tag), so a reconciler can ask the
-- other service about an operation whose outcome is unknown. NULL in local mode. Without
-- the secret a leaked table still reveals no key.
ALTER TABLE idemkey_records ADD COLUMN sealed_key BYTEA;

-- Who settled an operation whose outcome was unknown, when, and how. Entries are kept by
-- identity, not by row, so they outlive a released record. Times are milliseconds since
-- the Unix epoch.
CREATE TABLE idemkey_audit (
    id       BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant   TEXT    NOT NULL,
    key_hash BYTEA   NOT NULL,
    route    TEXT    NOT NULL,
    at       BIGINT  NOT NULL,
    actor    TEXT    NOT NULL,
    action   TEXT    NOT NULL,
    detail   TEXT    NOT NULL
);

CREATE INDEX idemkey_audit_record ON idemkey_audit (tenant, key_hash, route);
