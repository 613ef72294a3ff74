-- Server settings shared by every instance on this database (the key-hashing secret), for
-- `idemkey gateway` and `idemkey serve`. Tracked in idemkey_server_migrations. The payments
-- API's first migration makes the same table; a database it ran on has it already.
CREATE TABLE IF NOT EXISTS server_settings (
    name  TEXT PRIMARY KEY,
    value BLOB NOT NULL
);
