-- Evictions announced to other processes (an operator's `idemkey keys evict` runs in its own
-- process): each serving process polls this table and drops the record from its in-process
-- replay cache. `record_digest` is RecordId::digest (SHA-256 over tenant, key hash, route);
-- no key is kept. Rows older than a day are deleted by the next announcement.
CREATE TABLE idemkey_evictions (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    record_digest BLOB NOT NULL,
    at INTEGER NOT NULL
);
