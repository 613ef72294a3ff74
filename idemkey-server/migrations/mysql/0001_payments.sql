-- The reference payments API's own tables on MySQL and MariaDB (InnoDB, strict mode), with
-- the meaning of the PostgreSQL migration of the same name. They share the database with
-- idemkey's records; their migrations are tracked in sqlx's default table
-- (_sqlx_migrations), idemkey's in idemkey_migrations.
--
-- tenant is bytes (VARBINARY, the UTF-8 of the text), compared byte for byte as the store
-- compares its identities: every text collation folds case or, like utf8mb4_bin, ignores
-- trailing spaces. The other texts are only stored and shown. A value longer than its
-- column is refused (strict mode), never cut. created_at is the payment's RFC 3339 text,
-- as on the other databases.
CREATE TABLE payments (
    id          VARCHAR(64)    CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY,
    tenant      VARBINARY(255) NOT NULL,
    amount      BIGINT         NOT NULL,
    currency    VARCHAR(16)    CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    customer    VARCHAR(255)   CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    description TEXT           CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    status      VARCHAR(32)    CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    created_at  VARCHAR(40)    CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    KEY payments_tenant (tenant, created_at)
) ENGINE = InnoDB;

CREATE TABLE ledger_entries (
    id         BIGINT         NOT NULL AUTO_INCREMENT PRIMARY KEY,
    payment_id VARCHAR(64)    CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    tenant     VARBINARY(255) NOT NULL,
    amount     BIGINT         NOT NULL,
    currency   VARCHAR(16)    CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    created_at VARCHAR(40)    CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    CONSTRAINT ledger_entries_payment FOREIGN KEY (payment_id) REFERENCES payments (id)
) ENGINE = InnoDB;

-- Server settings shared by every instance on this database (the key-hashing secret).
CREATE TABLE server_settings (
    name  VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY,
    value BLOB         NOT NULL
) ENGINE = InnoDB;
