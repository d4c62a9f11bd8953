-- A ring whose rows are pushes, not messages: a prototype, in a schema of its own ({s}), not engine code.
--
-- The insert-only ring of flat_ring.sql writes a heap row and an index entry a message, where the
-- engine's ring updates a slot in place; under no hold that costs it more than it saves. Here a push of
-- n messages is ONE row (r, n, payloads bytea[]) of a segment table: one heap row and one index entry
-- a push (the array itself goes out of line to the segment's TOAST table, about one chunk row a 2 kB).
-- A message's id is (r << 16) | k for its place k in the row (0-based), so ids still rise in push order.
--
-- Rows are numbered by one sequence; row r lives in segment table q_{(r / S) % 4} (S = seg_rows),
-- which holds one generation (r / S) at a time, as in flat_ring.sql: a push that enters a segment still
-- holding an older generation returns that generation, and the producer rotates it (TRUNCATE of the
-- segment's rows and positions, in a transaction of its own) once every consumer is past it.
--
-- Lanes deal rows, not messages: row r belongs to lane r % L. A pop locks up to half the lanes that no
-- other pop holds (advisory transaction locks, from a lane chosen at random), reads each lane's position (a message id: the row and the place
-- in it where the lane goes on) from an insert-only position log, takes rows of those lanes in row
-- order, contiguous per lane (a lane's next row must be its last row + L: a row not written yet stops
-- the lane), up to n messages, possibly ending inside a row, and logs each moved lane's new position
-- in the segment of the last row it took from. A pop writes one log row a lane it moved, whatever n.
-- At least once (p_lease): the pop also inserts one lease row (its first and last ids, the lanes'
-- positions it started from, the lease's end) in the segment of its first row, and an ack inserts one
-- row naming the lease; an open lease (no ack row) holds the floor. Redelivery (an expired lease, a
-- nack) is not built here. A pop that finds every lane held,
-- or only lanes with nothing to take, returns nothing (the caller pops again).
--
-- pop's p_variant 'stop0' to 'stop3' return early at the points marked, so that a counting session
-- can tell what each part of a pop costs (flat_rows_instructions.py --parts); 'rows' is the pop.

CREATE SCHEMA {s};

CREATE TABLE {s}.meta (lanes integer NOT NULL, seg_rows bigint NOT NULL);
INSERT INTO {s}.meta VALUES ({lanes}, {seg_rows});

CREATE TABLE {s}.segs (seg integer PRIMARY KEY, gen bigint NOT NULL) WITH (fillfactor = 10);
INSERT INTO {s}.segs SELECT k, k FROM generate_series(0, 3) k;

CREATE SEQUENCE {s}.row_seq AS bigint MINVALUE 0 START 0 CACHE 1;
-- The newest generation any pop has logged a position in (a sequence: set without a dead row). Raised
-- under an advisory lock, so it only rises; raised before the pop commits, so a lane's newest log row
-- is never in a newer segment than it says; a pop that rolls back may leave it raised to a generation
-- whose segment then holds nothing older.
CREATE SEQUENCE {s}.pos_gen AS bigint MINVALUE 0 START 0 CACHE 1;

DO $$
BEGIN
    FOR k IN 0 .. 3 LOOP
        EXECUTE format('CREATE TABLE {s}.q_%s (r bigint PRIMARY KEY, n integer NOT NULL, '
                       'enqueued_at timestamptz NOT NULL, payloads bytea[] NOT NULL)', k);
        EXECUTE format('ALTER TABLE {s}.q_%s ALTER COLUMN payloads SET STORAGE EXTERNAL', k);
        EXECUTE format('CREATE TABLE {s}.pos_%s (lane integer NOT NULL, at bigint NOT NULL, '
                       'PRIMARY KEY (lane, at))', k);
        EXECUTE format('CREATE TABLE {s}.lease_%s (lo bigint PRIMARY KEY, hi bigint NOT NULL, '
                       'starts bigint[] NOT NULL, lease_until timestamptz NOT NULL)', k);
        EXECUTE format('CREATE TABLE {s}.ack_%s (lo bigint PRIMARY KEY)', k);
    END LOOP;
END $$;

CREATE VIEW {s}.leases AS
    SELECT * FROM {s}.lease_0 UNION ALL SELECT * FROM {s}.lease_1
    UNION ALL SELECT * FROM {s}.lease_2 UNION ALL SELECT * FROM {s}.lease_3;
CREATE VIEW {s}.acks AS
    SELECT * FROM {s}.ack_0 UNION ALL SELECT * FROM {s}.ack_1
    UNION ALL SELECT * FROM {s}.ack_2 UNION ALL SELECT * FROM {s}.ack_3;

CREATE VIEW {s}.q AS
    SELECT * FROM {s}.q_0 UNION ALL SELECT * FROM {s}.q_1
    UNION ALL SELECT * FROM {s}.q_2 UNION ALL SELECT * FROM {s}.q_3;

-- Every lane starts at its first row, place 0.
INSERT INTO {s}.pos_0 SELECT k, (k::bigint << 16) FROM generate_series(0, {lanes} - 1) k;

-- A lane's position: the highest at in the four segments' logs (one backward probe each).
CREATE FUNCTION {s}.lane_pos(p_lane integer) RETURNS bigint LANGUAGE sql STABLE AS $$
    SELECT greatest(
        (SELECT max(at) FROM {s}.pos_0 WHERE lane = p_lane), (SELECT max(at) FROM {s}.pos_1 WHERE lane = p_lane),
        (SELECT max(at) FROM {s}.pos_2 WHERE lane = p_lane), (SELECT max(at) FROM {s}.pos_3 WHERE lane = p_lane))
$$;

-- The floor, in rows: the lowest row a consumer still needs (a lane's position, an open lease).
CREATE FUNCTION {s}.floor_row() RETURNS bigint LANGUAGE sql STABLE AS $$
    SELECT least(
        (SELECT min({s}.lane_pos(k) >> 16) FROM generate_series(0, (SELECT lanes FROM {s}.meta) - 1) k),
        (SELECT min(e.lo >> 16) FROM {s}.leases e WHERE NOT EXISTS (SELECT 1 FROM {s}.acks a WHERE a.lo = e.lo)))
$$;

-- Push a batch as one row, in the caller's transaction. r_first: the row's first id, or NULL with
-- r_need the generation that must be rotated in first (nothing taken). The row number is taken under a
-- session advisory lock held for the check and nextval, so a push never holds a number it cannot write.
CREATE FUNCTION {s}.push(p_payloads bytea[], OUT r_first bigint, OUT r_need bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_s bigint := {seg_rows};
    v_r bigint;
    v_k integer;
    v_ok boolean;
BEGIN
    v_ok := pg_advisory_lock(7201, 0) IS NULL;
    v_r := coalesce(pg_sequence_last_value('{s}.row_seq'), -1) + 1;
    v_k := (v_r / v_s % 4)::integer;
    IF NOT EXISTS (SELECT 1 FROM {s}.segs t WHERE t.seg = v_k AND t.gen = v_r / v_s) THEN
        v_ok := pg_advisory_unlock(7201, 0);
        r_need := v_r / v_s;
        RETURN;
    END IF;
    v_r := nextval('{s}.row_seq');
    v_ok := pg_advisory_unlock(7201, 0);
    IF v_k = 0 THEN
        INSERT INTO {s}.q_0 VALUES (v_r, cardinality(p_payloads), now(), p_payloads);
    ELSIF v_k = 1 THEN
        INSERT INTO {s}.q_1 VALUES (v_r, cardinality(p_payloads), now(), p_payloads);
    ELSIF v_k = 2 THEN
        INSERT INTO {s}.q_2 VALUES (v_r, cardinality(p_payloads), now(), p_payloads);
    ELSE
        INSERT INTO {s}.q_3 VALUES (v_r, cardinality(p_payloads), now(), p_payloads);
    END IF;
    r_first := v_r << 16;
END
$$;

-- Empty the segment of generation p_gen - 4 and give it to p_gen, in a transaction of its own. False
-- while a consumer still needs that segment. Every lane must be past it by a lane's width of rows, so
-- that every lane's newest log row lies in a later segment.
CREATE FUNCTION {s}.rotate(p_gen bigint, p_variant text) RETURNS boolean
LANGUAGE plpgsql SET lock_timeout = '50ms' AS $$
DECLARE
    v_s bigint := {seg_rows};
    v_k integer := (p_gen % 4)::integer;
    v_gen bigint;
BEGIN
    SELECT gen INTO v_gen FROM {s}.segs WHERE seg = v_k FOR UPDATE;
    IF v_gen >= p_gen THEN
        RETURN true;
    END IF;
    IF {s}.floor_row() < (p_gen - 3) * v_s + {lanes} THEN
        RETURN false;
    END IF;
    EXECUTE format('TRUNCATE {s}.pos_%s, {s}.q_%s, {s}.lease_%s, {s}.ack_%s', v_k, v_k, v_k, v_k);
    UPDATE {s}.segs SET gen = p_gen WHERE seg = v_k;
    RETURN true;
EXCEPTION WHEN lock_not_available THEN
    RETURN false;
END
$$;

-- Pop up to p_n messages at most once, in the caller's transaction. Every statement names one segment
-- table (a PL/pgSQL branch a segment): a statement that names all four opens and locks all four on every
-- run, which measured several times the cost of the probe itself.
CREATE FUNCTION {s}.pop(p_n integer, p_variant text, p_lease boolean, p_vt double precision)
RETURNS TABLE (r_seq bigint, r_payload bytea)
LANGUAGE plpgsql AS $$
DECLARE
    v_l integer := {lanes};
    v_s bigint := {seg_rows};
    v_newest integer;
    v_locked integer[];
    v_at bigint[];           -- per locked lane (same order): its position
    v_lo bigint;             -- the lowest row any locked lane needs
    v_left integer := p_n;
    v_next bigint[];         -- per lane (1-based by lane): the next row it may take, NULL when stopped
    v_first_at bigint[];     -- per lane: its position
    v_rows bigint[] := '{}';
    v_from integer[] := '{}';
    v_to integer[] := '{}';
    v_n integer[] := '{}';
    v_newat bigint[];
    v_seg integer[];
    v_pl bytea[];
    rec record;
    v_lane integer;
    v_first integer;
    v_take integer;
    v_k integer;
    v_gen bigint;
    v_cur refcursor;
    v_start integer := floor(random() * {lanes})::integer;
BEGIN
    IF p_variant = 'stop0' THEN RETURN; END IF;
    -- Up to half the lanes that no other pop holds, from a lane chosen at random (so that consumers
    -- popping at the same time share the lanes instead of one taking all), locked, and their positions. A lane logs its position in the
    -- segment of the last row it took from, and rows rise with generations, so its newest log row is in
    -- the newest segment where it has one: first the newest segment any pop logged in, then older ones.
    -- The positions are read by a statement after the one that locks: a statement's snapshot is taken
    -- when it starts, so one that locked a lane and read its position would read it as it was before a
    -- pop that released the lane committed, and take the same rows again.
    SELECT array_agg(x.k ORDER BY x.k) INTO v_locked FROM (
        SELECT (v_start + i) % v_l AS k FROM generate_series(0, v_l - 1) i
        WHERE pg_try_advisory_xact_lock(7202, (v_start + i) % v_l) LIMIT greatest(1, v_l / 2)) x;
    IF v_locked IS NULL THEN  -- every lane held by another pop
        RETURN;
    END IF;
    v_newest := (coalesce(pg_sequence_last_value('{s}.pos_gen'), 0) % 4)::integer;
    IF v_newest = 0 THEN
        SELECT array_agg((SELECT max(p.at) FROM {s}.pos_0 p WHERE p.lane = u.k) ORDER BY u.o) INTO v_at FROM unnest(v_locked) WITH ORDINALITY u(k, o);
    ELSIF v_newest = 1 THEN
        SELECT array_agg((SELECT max(p.at) FROM {s}.pos_1 p WHERE p.lane = u.k) ORDER BY u.o) INTO v_at FROM unnest(v_locked) WITH ORDINALITY u(k, o);
    ELSIF v_newest = 2 THEN
        SELECT array_agg((SELECT max(p.at) FROM {s}.pos_2 p WHERE p.lane = u.k) ORDER BY u.o) INTO v_at FROM unnest(v_locked) WITH ORDINALITY u(k, o);
    ELSE
        SELECT array_agg((SELECT max(p.at) FROM {s}.pos_3 p WHERE p.lane = u.k) ORDER BY u.o) INTO v_at FROM unnest(v_locked) WITH ORDINALITY u(k, o);
    END IF;
    -- Lanes with no log row there (consumers a segment or more behind the pushes): the older
    -- segments, newest first, one statement a segment for the lanes still missing.
    v_k := v_newest;
    WHILE array_position(v_at, NULL) IS NOT NULL LOOP
        v_k := (v_k + 3) % 4;
        EXIT WHEN v_k = v_newest;
        IF v_k = 0 THEN
            SELECT array_agg(CASE WHEN u.at IS NULL THEN (SELECT max(p.at) FROM {s}.pos_0 p WHERE p.lane = u.k) ELSE u.at END ORDER BY u.o) INTO v_at FROM unnest(v_locked, v_at) WITH ORDINALITY u(k, at, o);
        ELSIF v_k = 1 THEN
            SELECT array_agg(CASE WHEN u.at IS NULL THEN (SELECT max(p.at) FROM {s}.pos_1 p WHERE p.lane = u.k) ELSE u.at END ORDER BY u.o) INTO v_at FROM unnest(v_locked, v_at) WITH ORDINALITY u(k, at, o);
        ELSIF v_k = 2 THEN
            SELECT array_agg(CASE WHEN u.at IS NULL THEN (SELECT max(p.at) FROM {s}.pos_2 p WHERE p.lane = u.k) ELSE u.at END ORDER BY u.o) INTO v_at FROM unnest(v_locked, v_at) WITH ORDINALITY u(k, at, o);
        ELSE
            SELECT array_agg(CASE WHEN u.at IS NULL THEN (SELECT max(p.at) FROM {s}.pos_3 p WHERE p.lane = u.k) ELSE u.at END ORDER BY u.o) INTO v_at FROM unnest(v_locked, v_at) WITH ORDINALITY u(k, at, o);
        END IF;
    END LOOP;
    IF p_variant = 'stop1' THEN RETURN; END IF;
    v_next := array_fill(NULL::bigint, ARRAY[v_l]);
    v_first_at := array_fill(NULL::bigint, ARRAY[v_l]);
    FOR i IN 1 .. cardinality(v_locked) LOOP
        v_next[v_locked[i] + 1] := v_at[i] >> 16;
        v_first_at[v_locked[i] + 1] := v_at[i];
    END LOOP;
    SELECT min(x >> 16) INTO v_lo FROM unnest(v_at) x;
    -- Rows of the held lanes from the lowest position on, in row order, without their payloads: the
    -- segment of the lowest position, then the next one if the pop is not full by its end.
    v_gen := v_lo / v_s;
    FOR part IN 1 .. 2 LOOP
        v_k := (v_gen % 4)::integer;
        IF v_k = 0 THEN
            OPEN v_cur FOR SELECT t.r, t.n FROM {s}.q_0 t WHERE t.r >= v_lo AND t.r < (v_gen + 1) * v_s AND (t.r % v_l)::integer = ANY (v_locked) ORDER BY t.r LIMIT p_n * cardinality(v_locked);
        ELSIF v_k = 1 THEN
            OPEN v_cur FOR SELECT t.r, t.n FROM {s}.q_1 t WHERE t.r >= v_lo AND t.r < (v_gen + 1) * v_s AND (t.r % v_l)::integer = ANY (v_locked) ORDER BY t.r LIMIT p_n * cardinality(v_locked);
        ELSIF v_k = 2 THEN
            OPEN v_cur FOR SELECT t.r, t.n FROM {s}.q_2 t WHERE t.r >= v_lo AND t.r < (v_gen + 1) * v_s AND (t.r % v_l)::integer = ANY (v_locked) ORDER BY t.r LIMIT p_n * cardinality(v_locked);
        ELSE
            OPEN v_cur FOR SELECT t.r, t.n FROM {s}.q_3 t WHERE t.r >= v_lo AND t.r < (v_gen + 1) * v_s AND (t.r % v_l)::integer = ANY (v_locked) ORDER BY t.r LIMIT p_n * cardinality(v_locked);
        END IF;
        LOOP
            FETCH v_cur INTO rec;
            EXIT WHEN NOT FOUND;
            v_lane := (rec.r % v_l)::integer;
            CONTINUE WHEN v_next[v_lane + 1] IS NULL OR rec.r < v_next[v_lane + 1];
            IF rec.r > v_next[v_lane + 1] THEN  -- a row of this lane not written yet: the lane stops
                v_next[v_lane + 1] := NULL;
                CONTINUE;
            END IF;
            v_first := CASE WHEN (v_first_at[v_lane + 1] >> 16) = rec.r
                            THEN (v_first_at[v_lane + 1] & 65535)::integer ELSE 0 END;
            v_take := least(rec.n - v_first, v_left);
            v_rows := v_rows || rec.r;
            v_from := v_from || v_first;
            v_to := v_to || (v_first + v_take);
            v_n := v_n || rec.n;
            v_left := v_left - v_take;
            v_next[v_lane + 1] := rec.r + v_l;
            EXIT WHEN v_left = 0;
        END LOOP;
        CLOSE v_cur;
        EXIT WHEN v_left = 0;
        v_gen := v_gen + 1;
        v_lo := v_gen * v_s;
    END LOOP;
    IF cardinality(v_rows) = 0 OR p_variant = 'stop2' THEN
        RETURN;
    END IF;
    -- Each moved lane's new position, logged in the segment of the last row it took from: past that
    -- row when the pop took it to its end, else the place in it where the pop stopped.
    v_newat := array_fill(NULL::bigint, ARRAY[v_l]);
    v_seg := array_fill(NULL::integer, ARRAY[v_l]);
    FOR i IN 1 .. cardinality(v_rows) LOOP
        v_lane := (v_rows[i] % v_l)::integer;
        v_newat[v_lane + 1] := CASE WHEN v_to[i] = v_n[i] THEN (v_rows[i] + v_l) << 16
                                    ELSE (v_rows[i] << 16) | v_to[i] END;
        v_seg[v_lane + 1] := (v_rows[i] / v_s % 4)::integer;
    END LOOP;
    FOR k IN 0 .. 3 LOOP
        CONTINUE WHEN NOT (k = ANY (v_seg));
        IF k = 0 THEN
            INSERT INTO {s}.pos_0 SELECT u.lane - 1, u.at FROM unnest(v_newat, v_seg) WITH ORDINALITY u(at, sg, lane) WHERE u.sg = 0;
        ELSIF k = 1 THEN
            INSERT INTO {s}.pos_1 SELECT u.lane - 1, u.at FROM unnest(v_newat, v_seg) WITH ORDINALITY u(at, sg, lane) WHERE u.sg = 1;
        ELSIF k = 2 THEN
            INSERT INTO {s}.pos_2 SELECT u.lane - 1, u.at FROM unnest(v_newat, v_seg) WITH ORDINALITY u(at, sg, lane) WHERE u.sg = 2;
        ELSE
            INSERT INTO {s}.pos_3 SELECT u.lane - 1, u.at FROM unnest(v_newat, v_seg) WITH ORDINALITY u(at, sg, lane) WHERE u.sg = 3;
        END IF;
    END LOOP;
    v_gen := (SELECT max(x) FROM unnest(v_rows) x) / v_s;
    IF v_gen > coalesce(pg_sequence_last_value('{s}.pos_gen'), 0) THEN
        PERFORM pg_advisory_xact_lock(7203, 0);
        IF v_gen > coalesce(pg_sequence_last_value('{s}.pos_gen'), 0) THEN
            PERFORM setval('{s}.pos_gen', v_gen);
        END IF;
    END IF;
    IF p_lease THEN  -- one lease row, in the segment of the first row taken
        v_k := (v_rows[1] / v_s % 4)::integer;
        IF v_k = 0 THEN
            INSERT INTO {s}.lease_0 VALUES ((v_rows[1] << 16) | v_from[1], (v_rows[cardinality(v_rows)] << 16) | (v_to[cardinality(v_to)] - 1), v_at, now() + make_interval(secs => p_vt));
        ELSIF v_k = 1 THEN
            INSERT INTO {s}.lease_1 VALUES ((v_rows[1] << 16) | v_from[1], (v_rows[cardinality(v_rows)] << 16) | (v_to[cardinality(v_to)] - 1), v_at, now() + make_interval(secs => p_vt));
        ELSIF v_k = 2 THEN
            INSERT INTO {s}.lease_2 VALUES ((v_rows[1] << 16) | v_from[1], (v_rows[cardinality(v_rows)] << 16) | (v_to[cardinality(v_to)] - 1), v_at, now() + make_interval(secs => p_vt));
        ELSE
            INSERT INTO {s}.lease_3 VALUES ((v_rows[1] << 16) | v_from[1], (v_rows[cardinality(v_rows)] << 16) | (v_to[cardinality(v_to)] - 1), v_at, now() + make_interval(secs => p_vt));
        END IF;
    END IF;
    IF p_variant = 'stop3' THEN RETURN; END IF;
    -- The messages: each taken row's slice of payloads, in row order.
    FOR i IN 1 .. cardinality(v_rows) LOOP
        v_k := (v_rows[i] / v_s % 4)::integer;
        IF v_k = 0 THEN
            SELECT t.payloads[v_from[i] + 1 : v_to[i]] INTO v_pl FROM {s}.q_0 t WHERE t.r = v_rows[i];
        ELSIF v_k = 1 THEN
            SELECT t.payloads[v_from[i] + 1 : v_to[i]] INTO v_pl FROM {s}.q_1 t WHERE t.r = v_rows[i];
        ELSIF v_k = 2 THEN
            SELECT t.payloads[v_from[i] + 1 : v_to[i]] INTO v_pl FROM {s}.q_2 t WHERE t.r = v_rows[i];
        ELSE
            SELECT t.payloads[v_from[i] + 1 : v_to[i]] INTO v_pl FROM {s}.q_3 t WHERE t.r = v_rows[i];
        END IF;
        RETURN QUERY SELECT (v_rows[i] << 16) | (v_from[i] + u.o - 1), u.p FROM unnest(v_pl) WITH ORDINALITY u(p, o);
    END LOOP;
END
$$;

-- Ack a whole lease by its lowest id: one insert-only row in the segment of the lease. False when there
-- is no such open lease (acked already, or its segment reused).
CREATE FUNCTION {s}.ack(p_lo bigint) RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    v_k integer := ((p_lo >> 16) / {seg_rows} % 4)::integer;
BEGIN
    IF v_k = 0 THEN
        INSERT INTO {s}.ack_0 SELECT e.lo FROM {s}.lease_0 e WHERE e.lo = p_lo ON CONFLICT DO NOTHING;
    ELSIF v_k = 1 THEN
        INSERT INTO {s}.ack_1 SELECT e.lo FROM {s}.lease_1 e WHERE e.lo = p_lo ON CONFLICT DO NOTHING;
    ELSIF v_k = 2 THEN
        INSERT INTO {s}.ack_2 SELECT e.lo FROM {s}.lease_2 e WHERE e.lo = p_lo ON CONFLICT DO NOTHING;
    ELSE
        INSERT INTO {s}.ack_3 SELECT e.lo FROM {s}.lease_3 e WHERE e.lo = p_lo ON CONFLICT DO NOTHING;
    END IF;
    RETURN FOUND;
END
$$;
