-- The reference payments API's own tables. They share the database with idemkey's
-- records; their migrations are tracked in sqlx's default table (_sqlx_migrations),
-- idemkey's in idemkey_migrations.
CREATE TABLE payments (
    id          TEXT    PRIMARY KEY,
    tenant      TEXT    NOT NULL,
    amount      INTEGER NOT NULL,
    currency    TEXT    NOT NULL,
    customer    TEXT    NOT NULL,
    description TEXT,
    status      TEXT    NOT NULL,
    created_at  TEXT    NOT NULL
);
CREATE INDEX payments_tenant ON payments (tenant, created_at);

CREATE TABLE ledger_entries (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    payment_id TEXT    NOT NULL REFERENCES payments (id),
    tenant     TEXT    NOT NULL,
    amount     INTEGER NOT NULL,
    currency   TEXT    NOT NULL,
    created_at TEXT    NOT NULL
);

-- Server settings shared by every instance on this database (the key-hashing secret).
CREATE TABLE server_settings (
    name  TEXT PRIMARY KEY,
    value BLOB NOT NULL
);
