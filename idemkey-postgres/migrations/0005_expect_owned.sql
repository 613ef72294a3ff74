-- The guard of the completion PgStore sends with the COMMIT in one message
-- (`EXECUTE idemkey_complete_v1(…); COMMIT; BEGIN`, src/store.rs): raises, and so skips the
-- COMMIT, unless the completing UPDATE matched exactly one row carrying the owner's token.
-- SQLSTATE IK001 is this crate's own.
CREATE FUNCTION idemkey_expect_owned(matched BIGINT) RETURNS VOID
LANGUAGE plpgsql AS $$
BEGIN
    IF matched <> 1 THEN
        RAISE EXCEPTION 'the idempotency record no longer carries this owner''s token'
            USING ERRCODE = 'IK001';
    END IF;
END
$$;
