-- Per-value digests of a JSON body, so that a 422 can name the first member that differs
-- (docs/fingerprint.md): a version byte, then per value 8 bytes of SHA-256 over its JSON
-- Pointer and 8 bytes of SHA-256 over its canonical value. Neither member names nor values
-- are kept in clear. NULL for bodies that are not JSON, past 256 values, and for records
-- written before this migration (their 422 names only the part that differs).
ALTER TABLE idemkey_records ADD COLUMN fingerprint_members BLOB;
