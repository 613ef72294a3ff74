-- A payment's reference stays unique per tenant, and a payment without one gives its unique
-- index no key. On a Galera cluster each key of a row's unique indexes is a certification key
-- unless every part of it is NULL: (tenant, reference) of a payment without a reference is
-- (tenant, NULL), one key for all of a tenant's payments, so two of them made at once on two
-- nodes failed certification (error 1213, 503 store-busy) though they shared nothing. The
-- index is now on (reference_tenant, reference): reference_tenant is the tenant when there is
-- a reference and NULL when there is none, so the pairs that must differ are the same as
-- before, and a payment without a reference has both parts NULL.
ALTER TABLE payments
    DROP KEY payments_tenant_reference,
    ADD COLUMN reference_tenant VARBINARY(255) AS (IF(reference IS NULL, NULL, tenant)) STORED,
    ADD UNIQUE KEY payments_tenant_reference (reference_tenant, reference);
