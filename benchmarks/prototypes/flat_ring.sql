-- A ring on insert-only segments: a prototype, in a schema of its own ({s}), not engine code.
--
-- Numbers come from one sequence, as in the engine's ring. Number x lives in segment (x / S) % NSEG of
-- the partitioned table q (S = seg_size); a push INSERTs its rows, so a push leaves no dead row. A
-- segment holds one generation (x / S) at a time: before a push may write numbers of generation g, the
-- segment's previous generation g - NSEG must be behind every consumer, and a rotation (rotate) empties
-- that segment with TRUNCATE and marks it as holding g (one UPDATE of a 4-row table per rotation).
-- Back-pressure is per segment: pushes wait while the floor is in the segment they would empty.
--
-- Lanes: number x belongs to lane x % L, as in the engine; a pop takes every lane it can lock
-- (pg_try_advisory_xact_lock, released at the end of the pop's transaction), reads each lane from its
-- position up to its first unwritten number, and moves the lanes it took from on. Where a lane's
-- position lives is the variant:
--   'upd': a row per lane in lanes, UPDATEd by each pop (as ring_lanes today): a dead row per pop;
--   'log': an insert-only position log, poslog, partitioned by segment like q: each pop INSERTs the new
--          position of each lane it moved, in the segment of the lane's last taken number, and a lane's
--          position is the highest in the log. A segment's log is emptied with the segment: a rotation
--          needs every lane's last taken number past the segment, so every lane's newest log row lies in
--          another segment.
-- Both are transactional: a pop that rolls back moved nothing, so a pop in the caller's transaction
-- keeps its exactly-once meaning.
--
-- At least once ('log' variant, p_lease): the pop also INSERTs one lease row (lo, hi, lanes' starts,
-- until) into leaselog; an ack INSERTs one row into acklog naming the lease's lo. Both are partitioned
-- by segment like q (by the segment of lo) and emptied with it. An open lease is a lease row without an
-- ack row; it holds the floor at its lo.

CREATE SCHEMA {s};

CREATE TABLE {s}.meta (lanes integer NOT NULL, seg_size bigint NOT NULL, nseg integer NOT NULL);
INSERT INTO {s}.meta VALUES ({lanes}, {seg_size}, 4);

CREATE TABLE {s}.segs (seg integer PRIMARY KEY, gen bigint NOT NULL) WITH (fillfactor = 10);
INSERT INTO {s}.segs SELECT k, k FROM generate_series(0, 3) k;

CREATE SEQUENCE {s}.push_seq AS bigint MINVALUE 0 START 0 CACHE 1;

CREATE TABLE {s}.q (
    seg integer NOT NULL,
    seq bigint NOT NULL,
    enqueued_at timestamptz NOT NULL,
    payload bytea,
    PRIMARY KEY (seg, seq)
) PARTITION BY LIST (seg);

CREATE TABLE {s}.poslog (seg integer NOT NULL, lane integer NOT NULL, pos bigint NOT NULL)
PARTITION BY LIST (seg);
CREATE INDEX ON {s}.poslog (lane, pos);

CREATE TABLE {s}.leaselog (
    seg integer NOT NULL, lo bigint NOT NULL, hi bigint NOT NULL, starts bigint[] NOT NULL,
    lease_until timestamptz NOT NULL, PRIMARY KEY (seg, lo)) PARTITION BY LIST (seg);
CREATE TABLE {s}.acklog (seg integer NOT NULL, lo bigint NOT NULL, PRIMARY KEY (seg, lo))
PARTITION BY LIST (seg);

DO $$
BEGIN
    FOR k IN 0 .. 3 LOOP
        EXECUTE format('CREATE TABLE {s}.q_%s PARTITION OF {s}.q FOR VALUES IN (%s)', k, k);
        EXECUTE format('ALTER TABLE {s}.q_%s ALTER COLUMN payload SET STORAGE PLAIN', k);
        EXECUTE format('CREATE TABLE {s}.poslog_%s PARTITION OF {s}.poslog FOR VALUES IN (%s)', k, k);
        EXECUTE format('CREATE TABLE {s}.leaselog_%s PARTITION OF {s}.leaselog FOR VALUES IN (%s)', k, k);
        EXECUTE format('CREATE TABLE {s}.acklog_%s PARTITION OF {s}.acklog FOR VALUES IN (%s)', k, k);
    END LOOP;
END $$;

-- Today's way of keeping positions, for the 'upd' variant.
CREATE TABLE {s}.lanes (lane integer PRIMARY KEY, pos bigint NOT NULL) WITH (fillfactor = 10);
INSERT INTO {s}.lanes SELECT k, k FROM generate_series(0, {lanes} - 1) k;
INSERT INTO {s}.poslog SELECT 0, k, k FROM generate_series(0, {lanes} - 1) k;

-- The floor: the lowest number a consumer may still need (lowest lane position, lowest open lease).
CREATE FUNCTION {s}.floor(p_variant text) RETURNS bigint LANGUAGE sql STABLE AS $$
    SELECT least(
        CASE WHEN p_variant = 'upd' THEN (SELECT min(pos) FROM {s}.lanes)
             ELSE (SELECT min(m) FROM (SELECT max(pos) AS m FROM {s}.poslog GROUP BY lane) x) END,
        (SELECT min(e.lo) FROM {s}.leaselog e
         WHERE NOT EXISTS (SELECT 1 FROM {s}.acklog a WHERE a.seg = e.seg AND a.lo = e.lo)))
$$;

-- Push a batch in the caller's transaction. r_first: the first number (the ids are r_first ..
-- r_first + n - 1), or NULL with r_need the generation that must be rotated in first (nothing taken).
-- The numbers are taken under a session advisory lock, held for the check and the two sequence calls:
-- the segments of the numbers about to be taken are checked to hold their generation first, so a
-- push never holds numbers it cannot write (a rotation cannot undo that: it needs the floor past them).
CREATE FUNCTION {s}.push(p_payloads bytea[], OUT r_first bigint, OUT r_need bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_n integer := cardinality(p_payloads);
    v_s bigint;
    v_first bigint;
    v_ok boolean;
BEGIN
    SELECT seg_size INTO v_s FROM {s}.meta;
    v_ok := pg_advisory_lock(7101, 0) IS NULL;
    v_first := coalesce(pg_sequence_last_value('{s}.push_seq'), -1) + 1;
    SELECT min(g) INTO r_need FROM (VALUES (v_first / v_s), ((v_first + v_n - 1) / v_s)) v(g)
    WHERE NOT EXISTS (SELECT 1 FROM {s}.segs t WHERE t.seg = (v.g % 4)::integer AND t.gen = v.g);
    IF r_need IS NOT NULL THEN
        v_ok := pg_advisory_unlock(7101, 0);
        RETURN;
    END IF;
    v_first := nextval('{s}.push_seq');
    IF v_n > 1 THEN
        PERFORM setval('{s}.push_seq', v_first + v_n - 1);
    END IF;
    v_ok := pg_advisory_unlock(7101, 0);
    INSERT INTO {s}.q (seg, seq, enqueued_at, payload)
    SELECT ((v_first + i - 1) / v_s % 4)::integer, v_first + i - 1, now(), p
    FROM unnest(p_payloads) WITH ORDINALITY AS u(p, i);
    r_first := v_first;
END
$$;

-- Empty the segment of generation p_gen - 4 and give it to p_gen, in a transaction of its own (the
-- TRUNCATE's lock is held to its end). Returns false when some consumer still needs that segment (the
-- ring is full there: the producer waits and asks again). The floor must be past the segment by a
-- lane's width, so that every lane's newest position-log row lies in a later segment.
CREATE FUNCTION {s}.rotate(p_gen bigint, p_variant text) RETURNS boolean
LANGUAGE plpgsql SET lock_timeout = '2s' AS $$
DECLARE
    v_s bigint;
    v_l integer;
    v_k integer := (p_gen % 4)::integer;
    v_gen bigint;
BEGIN
    SELECT seg_size, lanes INTO v_s, v_l FROM {s}.meta;
    SELECT gen INTO v_gen FROM {s}.segs WHERE seg = v_k FOR UPDATE;
    IF v_gen >= p_gen THEN
        RETURN true;
    END IF;
    IF {s}.floor(p_variant) < (p_gen - 3) * v_s + v_l THEN
        RETURN false;
    END IF;
    -- In the order pops lock them (the position log, the messages, the leases; acks the acks last),
    -- so that a rotation waiting for a pop never holds what that pop waits for.
    EXECUTE format('TRUNCATE {s}.poslog_%s, {s}.q_%s, {s}.leaselog_%s, {s}.acklog_%s', v_k, v_k, v_k, v_k);
    UPDATE {s}.segs SET gen = p_gen WHERE seg = v_k;
    RETURN true;
END
$$;

-- Pop up to p_n messages, in the caller's transaction: lock the lanes that no other pop holds, read
-- each from its position up to its first unwritten number, keep the first p_n by number, and move the
-- lanes on past what was taken. p_lease: also write one lease row (at least once, 'log' only).
CREATE FUNCTION {s}.pop(p_n integer, p_variant text, p_lease boolean, p_vt double precision)
RETURNS TABLE (r_seq bigint, r_payload bytea)
LANGUAGE plpgsql SET lock_timeout = 1000 AS $$
DECLARE
    v_l integer;
    v_s bigint;
    v_locked integer[];
    v_pos bigint[];
    v_lo bigint;
    v_hi bigint;
    v_segs integer[];
    v_ids bigint[];
    v_pl bytea[];
BEGIN
    SELECT lanes, seg_size INTO v_l, v_s FROM {s}.meta;
    SELECT array_agg(k) INTO v_locked FROM generate_series(0, v_l - 1) k
    WHERE pg_try_advisory_xact_lock(7102, k);
    IF v_locked IS NULL THEN
        -- Other pops hold every lane: wait for one of them (as the engine's pops wait for a lane), and
        -- take it with whatever else is free by then. Under lock_timeout, as the engine's ring_take.
        v_locked := ARRAY[floor(random() * v_l)::integer];
        PERFORM pg_advisory_xact_lock(7102, v_locked[1]);
        SELECT v_locked || coalesce(array_agg(k), '{}') INTO v_locked FROM generate_series(0, v_l - 1) k
        WHERE k <> v_locked[1] AND pg_try_advisory_xact_lock(7102, k);
    END IF;
    v_pos := array_fill(NULL::bigint, ARRAY[v_l]);
    IF p_variant = 'upd' THEN
        SELECT array_agg(t.lane), array_agg(t.pos) INTO v_locked, v_ids
        FROM {s}.lanes t WHERE t.lane = ANY (v_locked);
    ELSE
        -- Each lane's newest row, by the log's index (one backward probe per segment).
        SELECT array_agg(k.lane), array_agg((SELECT max(p.pos) FROM {s}.poslog p WHERE p.lane = k.lane))
        INTO v_locked, v_ids
        FROM unnest(v_locked) AS k(lane);
    END IF;
    FOR i IN 1 .. cardinality(v_locked) LOOP
        v_pos[v_locked[i] + 1] := v_ids[i];
    END LOOP;
    -- The numbers to read: from the lowest position to the highest plus p_n of the held lanes' numbers.
    SELECT min(x), max(x) + (p_n::bigint * v_l + cardinality(v_locked) - 1) / cardinality(v_locked)
    INTO v_lo, v_hi FROM unnest(v_ids) x;
    SELECT array_agg(DISTINCT (g % 4)::integer) INTO v_segs FROM generate_series(v_lo / v_s, v_hi / v_s) g;
    -- Each lane's contiguous run from its position: its rn-th row must be pos + (rn - 1) * L.
    SELECT array_agg(w.seq ORDER BY w.seq), array_agg(w.payload ORDER BY w.seq) INTO v_ids, v_pl
    FROM (
        SELECT r.seq, r.payload FROM (
            SELECT t.seq, t.payload, t.seq % v_l AS lane,
                   row_number() OVER (PARTITION BY t.seq % v_l ORDER BY t.seq) AS rn
            FROM {s}.q t
            WHERE t.seg = ANY (v_segs) AND t.seq >= v_lo AND t.seq < v_hi
              AND t.seq % v_l = ANY (v_locked) AND t.seq >= v_pos[(t.seq % v_l)::integer + 1]) r
        WHERE r.seq = v_pos[r.lane::integer + 1] + (r.rn - 1) * v_l
        ORDER BY r.seq LIMIT p_n) w;
    IF v_ids IS NULL THEN
        RETURN;
    END IF;
    IF p_variant = 'upd' THEN
        UPDATE {s}.lanes t SET pos = m.top + v_l
        FROM (SELECT x % v_l AS lane, max(x) AS top FROM unnest(v_ids) x GROUP BY 1) m
        WHERE t.lane = m.lane;
    ELSE
        INSERT INTO {s}.poslog (seg, lane, pos)
        SELECT (m.top / v_s % 4)::integer, m.lane, m.top + v_l
        FROM (SELECT (x % v_l)::integer AS lane, max(x) AS top FROM unnest(v_ids) x GROUP BY 1) m;
    END IF;
    IF p_lease THEN
        INSERT INTO {s}.leaselog (seg, lo, hi, starts, lease_until)
        VALUES ((v_ids[1] / v_s % 4)::integer, v_ids[1], v_ids[cardinality(v_ids)], v_pos,
                now() + make_interval(secs => p_vt));
    END IF;
    RETURN QUERY SELECT u.i, u.p FROM unnest(v_ids, v_pl) AS u(i, p);
END
$$;

-- Ack a whole lease by its lowest id: one insert-only row. Returns false when there is no such open
-- lease (acked already, or its segment reused).
CREATE FUNCTION {s}.ack(p_lo bigint) RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    v_seg integer;
BEGIN
    SELECT e.seg INTO v_seg FROM {s}.leaselog e
    WHERE e.seg = (p_lo / (SELECT seg_size FROM {s}.meta) % 4)::integer AND e.lo = p_lo;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    INSERT INTO {s}.acklog (seg, lo) VALUES (v_seg, p_lo) ON CONFLICT DO NOTHING;
    RETURN FOUND;
END
$$;
