-- The time of the operation's first attempt, as the claiming request stated it
-- (`Repeatability-First-Sent`, milliseconds since the Unix epoch). A retry that states
-- another time is refused as a different request. NULL when the request did not state it,
-- and for records written before this migration.
ALTER TABLE idemkey_records ADD COLUMN first_sent INTEGER;
