-- One row per (tenant, key, route). The raw key is never stored: key_hash is
-- HMAC-SHA256(secret, tenant, key). Times are milliseconds since the Unix epoch.
CREATE TABLE idemkey_records (
    tenant            TEXT    NOT NULL,
    key_hash          BLOB    NOT NULL,
    route             TEXT    NOT NULL,
    fingerprint       BLOB    NOT NULL,
    fingerprint_parts BLOB    NOT NULL,
    state             TEXT    NOT NULL
        CHECK (state IN ('reserved', 'executing', 'completed', 'indeterminate')),
    token             INTEGER NOT NULL,
    lease_expires_at  INTEGER,
    response_status   INTEGER,
    response_headers  BLOB,
    response_body     BLOB,
    created_at        INTEGER NOT NULL,
    updated_at        INTEGER NOT NULL,
    expires_at        INTEGER NOT NULL,
    -- The claim's uniqueness, and the status resource's (tenant, key_hash) prefix look-up.
    PRIMARY KEY (tenant, key_hash, route)
);

-- Purge finds expired rows without scanning the table.
CREATE INDEX idemkey_records_expires_at ON idemkey_records (expires_at);
