-- Who settled an operation whose outcome was unknown, when, and how. Entries are kept by
-- identity, not by row, so they outlive a released record. Times are milliseconds since
-- the Unix epoch. The identity's columns are those of idemkey_records.
CREATE TABLE idemkey_audit (
    id       BIGINT          NOT NULL AUTO_INCREMENT PRIMARY KEY,
    tenant   VARBINARY(255)  NOT NULL,
    key_hash BINARY(32)      NOT NULL,
    route    VARBINARY(2048) NOT NULL,
    at       BIGINT          NOT NULL,
    actor    TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    action   TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    detail   TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    KEY idemkey_audit_record (tenant, key_hash, route)
) ENGINE = InnoDB;
