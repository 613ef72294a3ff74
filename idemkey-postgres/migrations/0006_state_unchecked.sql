-- The record's state is written only by this crate's statements, from `RecordState`, and
-- every read parses it back (an unknown state is `StoreError::Corrupt`). The CHECK that
-- also listed the states cost every claim and completion about 13 µs of the database's
-- time: PostgreSQL rebuilds a CHECK's expression from its stored text for each statement
-- that writes the row (docs/decisions.md, "No CHECK on the record's state").
ALTER TABLE idemkey_records DROP CONSTRAINT idemkey_records_state_check;
