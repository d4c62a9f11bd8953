-- Migration 7: ack deletes the held receipts' rows without locking them first (FOR UPDATE wrote a WAL
-- record and took a row lock per message); when some receipt does not hold its lease, the statement
-- calls receipts_not_held(), whose error rolls the whole statement back, so an ack stays all or nothing.

-- name: migrate
CREATE FUNCTION {schema}.receipts_not_held(p_wanted integer, p_held bigint) RETURNS bigint
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% of % receipts do not hold their lease', p_wanted - p_held, p_wanted
        USING ERRCODE = 'DQ005';
END
$$;
