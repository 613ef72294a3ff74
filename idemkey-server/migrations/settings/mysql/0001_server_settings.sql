-- Server settings shared by every instance on this database (the key-hashing secret), for
-- `idemkey gateway` and `idemkey serve`, on MySQL and MariaDB (InnoDB). Tracked in
-- idemkey_server_migrations. The payments API's first migration makes the same table; a
-- database it ran on has it already.
CREATE TABLE IF NOT EXISTS server_settings (
    name  VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY,
    value BLOB         NOT NULL
) ENGINE = InnoDB;
