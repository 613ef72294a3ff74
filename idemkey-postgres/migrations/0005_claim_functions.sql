-- The two statements PgStore sends inside the messages that begin and end a local-mode
-- transaction (`BEGIN; SELECT idemkey_claim(…)` and
-- `SELECT idemkey_complete(…, true); COMMIT; BEGIN`). Values travel as
-- literals there (see src/literal.rs), so the statements are kept in functions, whose plans
-- PL/pgSQL caches for the session, rather than planned afresh on every call.

-- The claim of a fresh key: a plain INSERT, so a taken key fails with unique_violation
-- (23505), which ends the message before the caller's statements run.
CREATE FUNCTION idemkey_claim(
    p_tenant TEXT, p_key_hash BYTEA, p_route TEXT, p_fingerprint BYTEA,
    p_fingerprint_parts BYTEA, p_state TEXT, p_lease_expires_at BIGINT, p_now BIGINT,
    p_expires_at BIGINT, p_sealed_key BYTEA, p_fingerprint_members BYTEA
) RETURNS VOID
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO idemkey_records (tenant, key_hash, route, fingerprint, fingerprint_parts,
                                 state, token, lease_expires_at, created_at, updated_at,
                                 expires_at, sealed_key, fingerprint_members)
    VALUES (p_tenant, p_key_hash, p_route, p_fingerprint, p_fingerprint_parts, p_state, 1,
            p_lease_expires_at, p_now, p_now, p_expires_at, p_sealed_key,
            p_fingerprint_members);
END
$$;

-- Stores the outcome if the record still carries the owner's token; true when it did.
-- With p_strict, a record that does not carry it raises SQLSTATE IK001 (this crate's own)
-- instead, which skips the COMMIT sent after it in the same message.
CREATE FUNCTION idemkey_complete(
    p_tenant TEXT, p_key_hash BYTEA, p_route TEXT, p_token BIGINT, p_status INTEGER,
    p_headers BYTEA, p_body BYTEA, p_now BIGINT, p_strict BOOLEAN
) RETURNS BOOLEAN
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE idemkey_records
       SET state = 'completed', token = token + 1, lease_expires_at = NULL,
           response_status = p_status, response_headers = p_headers, response_body = p_body,
           updated_at = p_now
     WHERE tenant = p_tenant AND key_hash = p_key_hash AND route = p_route
       AND token = p_token;
    IF p_strict AND NOT FOUND THEN
        RAISE EXCEPTION 'the idempotency record no longer carries this owner''s token'
            USING ERRCODE = 'IK001';
    END IF;
    RETURN FOUND;
END
$$;
