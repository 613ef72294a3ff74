-- A reference of the client's own for a payment (an invoice number, a transfer id), unique
-- per tenant for good: it outlives the idempotency record, so a payment retried after the
-- record's retention finds the first one instead of being made twice. NULL: no reference,
-- and no index entry (most payments carry none).
ALTER TABLE payments ADD COLUMN reference TEXT;
CREATE UNIQUE INDEX payments_tenant_reference ON payments (tenant, reference)
    WHERE reference IS NOT NULL;
