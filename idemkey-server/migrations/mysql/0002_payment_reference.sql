-- A reference of the client's own for a payment (an invoice number, a transfer id), unique
-- per tenant for good: it outlives the idempotency record, so a payment retried after the
-- record's retention finds the first one instead of being made twice. NULL: no reference;
-- InnoDB's unique index admits any number of NULLs, as PostgreSQL's partial index does.
-- Bytes (VARBINARY, up to 128 characters of UTF-8), compared byte for byte like tenant.
ALTER TABLE payments
    ADD COLUMN reference VARBINARY(512) NULL,
    ADD UNIQUE KEY payments_tenant_reference (tenant, reference);
