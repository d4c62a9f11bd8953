-- The functions of a dbqueue schema on PostgreSQL: every one of them, in their current form. {schema} is
-- replaced by the quoted schema name. install() applies this file after schema.sql on a fresh install,
-- and again, in one transaction, whenever its SHA-256 differs from the one recorded in owned_objects
-- (kind 'functions'), so changing a function is an edit of its body here, nothing else. Each is
-- CREATE OR REPLACE: replacing a function while pushes and pops run is safe (a statement that already
-- runs it finishes with the body it started with; the next call gets the new one).
--
-- The contract with the client (the named queries in queries/*.sql): the client calls these functions
-- by name, with the arguments listed here. A function's arguments (their number, types or names) and
-- its result never change under its name: a change of either gives the function a new name, and the
-- old one stays in this file, working, for one more release, so that the code of the release before
-- keeps working against a schema of this one during a rolling upgrade; the release after removes it
-- from this file, and install() then drops it (an engine's function that this file no longer defines).
-- CREATE OR REPLACE would refuse such a change in place anyway (it cannot change a result type or an
-- argument's name). A test checks that every function the named queries call is defined here
-- with a matching number of arguments.

-- name: functions
-- Raised by ack when some of its receipts no longer hold their lease: the error rolls the whole
-- statement back, so an ack finishes every message it names or none, without locking them first.
CREATE OR REPLACE FUNCTION {schema}.receipts_not_held(p_wanted integer, p_held bigint) RETURNS bigint
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% of % receipts do not hold their lease', p_wanted - p_held, p_wanted
        USING ERRCODE = 'DQ005';
END
$$;

-- What a push of the table design does about notifying (see table_push): p_notify 0 and 2 as they are,
-- and 1 decided by the queue's waiters' lock first: 0 when the push took it (nobody waits registered),
-- 2 when a waiter holds it, 1 when another push holds it (then the question whether the queue had a
-- ready message decides). table_push's general path and table_push_with() ask it. A single expression
-- of its arguments, so that PostgreSQL inlines it where it is called: the caller's assignment is then
-- still a simple expression, which costs what the expression written there costs.
CREATE OR REPLACE FUNCTION {schema}.table_notify_for(p_queue_id integer, p_notify integer) RETURNS integer
LANGUAGE sql VOLATILE AS $$
    SELECT CASE
        WHEN p_notify <> 1 THEN p_notify
        WHEN pg_try_advisory_xact_lock(hashtext('dbqueue.waiters.' || '{schema}'), p_queue_id) THEN 0
        WHEN pg_try_advisory_lock_shared(hashtext('dbqueue.waiters.' || '{schema}'), p_queue_id)
             AND pg_advisory_unlock_shared(hashtext('dbqueue.waiters.' || '{schema}'), p_queue_id) THEN 2
        ELSE 1 END
$$;

-- The table design's push: n messages into queue p_queue_id in one call, ids in payload order; none
-- when the queue does not exist (a dropped queue's handle writes nothing). It first takes the queue's
-- push lock in shared mode, held to the end of the transaction: drop_queue takes it exclusively, so a
-- drop waits for every push in progress, and a push that comes during a drop waits for it. Then it
-- reads queues with a snapshot taken after the lock (each statement of a function in READ COMMITTED
-- gets its own), so a push that waited for a drop finds the queue gone. The usual push (READ
-- COMMITTED, small payloads, no notification) reads that row in the INSERT itself, which writes
-- nothing when it is gone: a separate check would start an executor of its own (about 17,000
-- instructions). Under REPEATABLE READ or SERIALIZABLE the transaction's snapshot may predate the
-- drop: there the queue's row is locked FOR KEY SHARE, which fails with a serialization error when a
-- drop committed meanwhile (the caller runs its transaction again and finds the queue gone).
-- Ids come from the sequence in payload order. A payload of up to 1900 bytes goes into the meta row, a
-- larger one into data (see meta). p_inline says that every payload is small (the caller knows their
-- sizes): then one INSERT writes the meta rows and returns their ids in the order it inserted them,
-- which is the order unnest() yields the payloads (see the statement). Otherwise one statement writes
-- meta and data rows from a materialized, numbered input and sorts the ids back into payload order:
-- at 100 payloads a message that form cost the server about 4,000 more instructions than the single
-- INSERT (cachegrind).
-- p_notify: 0 never, 1 while somebody waits, or, when that cannot be told (below), when the queue had
-- no ready message before (asked before the INSERT, or in the same statement, whose one snapshot does
-- not see this push's own rows), 2 always. The usual push sends
-- its notification after the INSERT (as an expression, when the INSERT wrote rows), so that it is the
-- same INSERT whatever p_notify says: with its rows' ids numbered by unnest() rather than by a
-- materialized input, and no statement of its own for the queue's row, a push of 100 with notify 1 cost
-- about 2,100 fewer server instructions a message, a push of one about 50,000 fewer (cachegrind). The
-- check of 1 looks for the newest ready message of the queue in the generation pushes write now (one
-- partition, pruned at run time), walking meta_ready_idx backwards from its newest entry. Pops take the
-- oldest messages and leave their index entries at the other end until a VACUUM or the partition's
-- TRUNCATE removes them, so with messages waiting the walk stops at the first entry, however many were
-- popped since (walked forwards, from the oldest entry, it passed every one of them). Only when no
-- message of the queue is waiting in the partition does it pass the entries popped there, as a pop of
-- the empty queue does, and only those at or above the queue's floor (the floor the push reads anyway;
-- no ready message is below it), so the entries popped before the last raise of the floor are not
-- walked. It may only err towards notifying: when the queue's ready messages are all in older
-- generations (a queue pushed rarely while ids move on), the push notifies as if the queue had none, a
-- wake-up that finds messages; when it finds one, the queue had a ready message, as before. Delayed
-- messages of the queue in the partition are passed over one by one on a server without skip scans
-- (PostgreSQL 17 and older).
-- Before that question, p_notify 1 asks who waits (in the usual push as nested tests; elsewhere by
-- table_notify_for(), as v_notify, the setting the push then acts on): a process with waiting pops or
-- observers of the queue holds the queue's waiters' lock (key hashtext('dbqueue.waiters.' || schema),
-- queue_id) shared on its listening connection while they wait (hub.py), taken after its LISTEN and
-- before its waiters' first look. The push tries that lock exclusively, to the end of its transaction (a simple expression: a few
-- thousand instructions, where the question cost about 127,000 a push of one). Taken, nobody waits
-- registered, and no waiter can register before this push's rows are committed: no notification.
-- Not taken, a session try of it shared, released at once, tells a waiter (it holds it shared: notify,
-- even when the queue had ready messages, which another consumer's claim may hold) from another push
-- that holds it exclusively (then nobody waits registered, and the question decides as before, so that
-- concurrent pushes into a queue nobody waits on do not all notify). A push in progress may so send no
-- notification to a waiter that arrives meanwhile: one that took the lock (the waiter's try fails until
-- it commits), or one that asked the question. A waiting pop's look for pushes in progress
-- (queries/table.sql, pushing) finds either and looks again soon; a waiter tries the lock again before
-- each wait and looks again at once when it takes it (hub.py).
-- A function with generic plans: its statements are planned once a session, where a statement run by
-- itself is planned on every push (a third of a push of one's server time). No sequential scans:
-- the ready check must probe meta_ready_idx whatever the statistics said when the plan was made.
CREATE OR REPLACE FUNCTION {schema}.table_push(
    p_queue_id integer, p_payloads bytea[], p_priority smallint, p_delay_s double precision,
    p_notify integer, p_channel text, p_inline boolean)
RETURNS SETOF bigint
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
DECLARE
    -- Initial values, evaluated in this order as the block starts, each a simple expression (as an
    -- assignment is; PERFORM would run a query): the queue's push lock first, then its floor (table_floor)
    -- read under it, so that no raise comes before the commit; the push's time is not below the floor.
    v_locked text := pg_advisory_xact_lock_shared(hashtext('dbqueue.queue.' || '{schema}'), p_queue_id)::text;
    v_floor timestamptz := {schema}.table_floor(p_queue_id);
    v_at timestamptz := greatest(now() + make_interval(secs => p_delay_s), v_floor);
    v_gen smallint;
    v_quiet boolean;  -- NULL unless asked: then no notification for p_notify 1
    -- Outside the usual push: 0 never, 1 when the queue had no ready message before, 2 always; p_notify,
    -- but 1 decided by the queue's waiters' lock first (see above)
    v_notify integer;
BEGIN
    IF current_setting('transaction_isolation') = 'read committed' THEN
        IF p_inline THEN
            -- The waiters' lock as nested tests, each a simple expression, so that p_notify 0 and 2 test
            -- one thing, as they did before it.
            IF p_notify = 1 THEN
                IF pg_try_advisory_xact_lock(hashtext('dbqueue.waiters.' || '{schema}'), p_queue_id) THEN
                    NULL;  -- nobody waits: no notification (v_quiet NULL)
                ELSIF pg_try_advisory_lock_shared(hashtext('dbqueue.waiters.' || '{schema}'), p_queue_id)
                      AND pg_advisory_unlock_shared(hashtext('dbqueue.waiters.' || '{schema}'), p_queue_id) THEN
                    v_quiet := true;  -- a waiter holds it: notify, whatever the queue holds
                ELSE
                    -- Whether the queue had a ready message before this push, asked before its INSERT
                    -- (a statement of its own, whose snapshot cannot see this push's rows). The generation
                    -- pushes write now, as table_generation() has it, read here as a simple expression: a
                    -- role that pushes has SELECT on the sequence, and a call of that security-definer
                    -- function cost about 25,000 instructions. Nothing of the queue's that is ready is
                    -- below its floor.
                    v_gen := ((pg_sequence_last_value('{schema}.message_id_seq'::regclass) >> 14) & 7)::smallint;
                    v_quiet := (SELECT r.id FROM {schema}.meta r
                                WHERE r.gen = v_gen AND r.queue_id = p_queue_id AND r.state = 0
                                  AND r.process_at <= now() AND r.process_at >= v_floor
                                ORDER BY r.priority, r.process_at DESC, r.id DESC
                                LIMIT 1) IS NULL;
                END IF;
            END IF;
            -- The usual push: one INSERT, which reads the queue's row itself (no row, nothing written),
            -- and names every column in the types of meta, so that the plan passes each row on without
            -- projecting it again. A push of one takes its payload from the array without unnest().
            IF cardinality(p_payloads) = 1 THEN
                RETURN QUERY
                INSERT INTO {schema}.meta (id, queue_id, state, priority, attempts, process_at, enqueued_at,
                    lease_until, consumer, last_error, deliveries, payload, gen)
                SELECT x.id, x.queue_id, 0::smallint, p_priority, 0, v_at, now(),
                       NULL::timestamptz, NULL::text, NULL::text, 0, p_payloads[1], ((x.id >> 14) & 7)::smallint
                FROM (SELECT nextval('{schema}.message_id_seq') AS id, q.queue_id FROM {schema}.queues q
                      WHERE q.queue_id = p_queue_id) x
                RETURNING id;
            ELSE
                -- unnest() in a select list: its rows come one by one from the array, in order, without
                -- the store that a function scan in FROM fills first; nextval() runs above it, a row at a
                -- time in that order (a subquery whose select list calls a volatile function is never
                -- flattened into its parent, so the id is taken once a row and gen computed from it).
                RETURN QUERY
                INSERT INTO {schema}.meta (id, queue_id, state, priority, attempts, process_at, enqueued_at,
                    lease_until, consumer, last_error, deliveries, payload, gen)
                SELECT y.id, y.queue_id, 0::smallint, p_priority, 0, v_at, now(),
                       NULL::timestamptz, NULL::text, NULL::text, 0, y.payload, ((y.id >> 14) & 7)::smallint
                FROM (SELECT nextval('{schema}.message_id_seq') AS id, x.queue_id, x.payload
                      FROM (SELECT q.queue_id, unnest(p_payloads) AS payload FROM {schema}.queues q
                            WHERE q.queue_id = p_queue_id) x) y
                RETURNING id;
            END IF;
            -- FOUND: RETURN QUERY returned a row, so the queue was there and the push wrote its rows.
            IF FOUND AND (p_notify = 2 OR v_quiet) THEN
                v_locked := pg_notify(p_channel, '')::text;
            END IF;
            RETURN;
        END IF;
        IF NOT EXISTS (SELECT 1 FROM {schema}.queues WHERE queue_id = p_queue_id) THEN
            RETURN;
        END IF;
    ELSE
        PERFORM 1 FROM {schema}.queues WHERE queue_id = p_queue_id FOR KEY SHARE;
        IF NOT FOUND THEN
            RETURN;
        END IF;
    END IF;
    v_notify := {schema}.table_notify_for(p_queue_id, p_notify);
    IF p_inline AND v_notify = 0 THEN
        RETURN QUERY
        INSERT INTO {schema}.meta (id, queue_id, priority, process_at, enqueued_at, payload, gen)
        SELECT p.id, p_queue_id, p_priority, v_at, now(), p.payload,
               ((p.id >> 14) & 7)::smallint
        FROM (SELECT nextval('{schema}.message_id_seq') AS id, u.payload FROM unnest(p_payloads) AS u(payload)) p
        RETURNING id;
    ELSIF p_inline THEN
        RETURN QUERY
        WITH m AS (
            INSERT INTO {schema}.meta (id, queue_id, priority, process_at, enqueued_at, payload, gen)
            SELECT p.id, p_queue_id, p_priority, v_at, now(), p.payload,
                   ((p.id >> 14) & 7)::smallint
            FROM (SELECT nextval('{schema}.message_id_seq') AS id, u.payload FROM unnest(p_payloads) AS u(payload)) p
            RETURNING id
        ), n AS (
            SELECT pg_notify(p_channel, '') AS sent
            WHERE v_notify = 2 OR (
                SELECT r.id FROM {schema}.meta r
                WHERE r.gen = {schema}.table_generation() AND r.queue_id = p_queue_id AND r.state = 0
                  AND r.process_at <= now() AND r.process_at >= v_floor
                ORDER BY r.priority, r.process_at DESC, r.id DESC
                LIMIT 1) IS NULL
        )
        SELECT m.id FROM m CROSS JOIN (SELECT count(*) AS c FROM n) x;
    ELSIF v_notify = 0 THEN
        RETURN QUERY
        WITH input AS MATERIALIZED (
            SELECT nextval('{schema}.message_id_seq') AS id, p.payload, p.ord
            FROM unnest(p_payloads) WITH ORDINALITY AS p(payload, ord)
        ), m AS (
            INSERT INTO {schema}.meta (id, queue_id, priority, process_at, enqueued_at, payload, gen)
            SELECT i.id, p_queue_id, p_priority, v_at, now(),
                   CASE WHEN octet_length(i.payload) <= 1900 THEN i.payload END, ((i.id >> 14) & 7)::smallint
            FROM input i
        ), d AS (
            INSERT INTO {schema}.data (id, queue_id, payload, gen)
            SELECT i.id, p_queue_id, i.payload, ((i.id >> 14) & 7)::smallint FROM input i
            WHERE octet_length(i.payload) > 1900
        )
        SELECT i.id FROM input i ORDER BY i.ord;
    ELSE
        RETURN QUERY
        WITH input AS MATERIALIZED (
            SELECT nextval('{schema}.message_id_seq') AS id, p.payload, p.ord
            FROM unnest(p_payloads) WITH ORDINALITY AS p(payload, ord)
        ), m AS (
            INSERT INTO {schema}.meta (id, queue_id, priority, process_at, enqueued_at, payload, gen)
            SELECT i.id, p_queue_id, p_priority, v_at, now(),
                   CASE WHEN octet_length(i.payload) <= 1900 THEN i.payload END, ((i.id >> 14) & 7)::smallint
            FROM input i
        ), d AS (
            INSERT INTO {schema}.data (id, queue_id, payload, gen)
            SELECT i.id, p_queue_id, i.payload, ((i.id >> 14) & 7)::smallint FROM input i
            WHERE octet_length(i.payload) > 1900
        ), n AS (
            SELECT pg_notify(p_channel, '') AS sent
            WHERE v_notify = 2 OR (
                SELECT r.id FROM {schema}.meta r
                WHERE r.gen = {schema}.table_generation() AND r.queue_id = p_queue_id AND r.state = 0
                  AND r.process_at <= now() AND r.process_at >= v_floor
                ORDER BY r.priority, r.process_at DESC, r.id DESC
                LIMIT 1) IS NULL
        )
        -- (an inner join: the planner would remove an unused LEFT JOIN, and with it the NOTIFY)
        SELECT i.id FROM input i CROSS JOIN (SELECT count(*) AS c FROM n) x ORDER BY i.ord;
    END IF;
END
$$;

-- The table design's push with options (push(dedup_key=..., ttl=..., key=...)), where table_push() has
-- none: p_okeys (NULL: none) are ordering keys, p_okeys[i] the key of p_payloads[i] (NULL: the message
-- is ordered with no other) on a queue ordered per key (see table_take and below);
-- p_keys (NULL: none) are deduplication keys, p_keys[i] the key of p_payloads[i], distinct (the client
-- maps a key repeated within a batch to its first occurrence); p_ttl_s (NULL: none) is the messages'
-- time to live from now (meta_opt.expires_at). A message with a time to live or an ordering key gets
-- its meta_opt row (schema.sql) in the same statement as its meta row. Rows (r_id, r_new) in payload order: r_new when this call
-- pushed the message, otherwise r_id is the message that the key's first push within the queue's
-- dedup_window_s made (whether or not it was consumed since), and nothing was written for it. None when
-- the queue does not exist. The queue's push lock and its row are taken as in table_push().
-- Each key is claimed by an INSERT into dedup whose ON CONFLICT takes over a row older than the window
-- (the new id and time) and otherwise keeps it: the statement returns the id the row holds, so a key
-- whose row holds the id proposed here is new. Two pushes of one key in separate transactions meet on
-- dedup_pkey: the second waits for the first's transaction; if that committed, the second's ON CONFLICT
-- sees its row (READ COMMITTED reads the newest committed version there) and returns its id; if it
-- rolled back, the second inserts its own row and pushes its message. Under REPEATABLE READ or
-- SERIALIZABLE a key committed after the transaction's snapshot raises a serialization error instead
-- (the caller runs its transaction again and gets the first's id). Keys are claimed in key order, so two
-- batches sharing keys lock them in one order and do not deadlock each other. Ids are taken from the
-- sequence for every payload in payload order, so a batch's new messages keep their push order; a
-- duplicate leaves its number unused (ids have gaps already, as a rolled-back push leaves).
CREATE OR REPLACE FUNCTION {schema}.table_push_with(
    p_queue_id integer, p_payloads bytea[], p_keys text[], p_okeys text[], p_priority smallint,
    p_delay_s double precision, p_ttl_s double precision, p_notify integer, p_channel text)
RETURNS TABLE (r_id bigint, r_new boolean)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_locked text;
    v_window double precision;
    v_expires timestamptz := now() + make_interval(secs => p_ttl_s);
    v_at timestamptz := now() + make_interval(secs => p_delay_s);
    v_floor timestamptz;
    v_notify integer;  -- p_notify, but 1 decided by the queue's waiters' lock first, as in table_push()
BEGIN
    v_locked := pg_advisory_xact_lock_shared(hashtext('dbqueue.queue.' || '{schema}'), p_queue_id)::text;
    v_notify := {schema}.table_notify_for(p_queue_id, p_notify);
    v_floor := {schema}.table_floor(p_queue_id);  -- as table_push(), which bounds its check by it too
    v_at := greatest(v_at, v_floor);
    IF current_setting('transaction_isolation') = 'read committed' THEN
        SELECT q.dedup_window_s INTO v_window FROM {schema}.queues q WHERE q.queue_id = p_queue_id;
    ELSE
        SELECT q.dedup_window_s INTO v_window FROM {schema}.queues q WHERE q.queue_id = p_queue_id
        FOR KEY SHARE;
    END IF;
    IF v_window IS NULL THEN
        RETURN;
    END IF;
    IF p_okeys IS NOT NULL THEN
        -- Pushes of one ordering key serialize (a lock a key, to the end of the transaction, taken in
        -- key order), so a key's ids grow in the order its pushes commit: the claims' check of an
        -- earlier id is then a check of an earlier push. Two keys may share a lock (a hash collision),
        -- which only makes their pushes wait for each other.
        PERFORM pg_advisory_xact_lock(hashtext('dbqueue.okey.' || '{schema}') # p_queue_id, hashtext(k.okey))
        FROM (SELECT DISTINCT u.okey FROM unnest(p_okeys) AS u(okey) WHERE u.okey IS NOT NULL ORDER BY 1) k;
    END IF;
    IF p_keys IS NULL AND v_notify = 0
       AND (SELECT max(octet_length(u.payload)) FROM unnest(p_payloads) AS u(payload)) <= 1900 THEN
        -- Without deduplication keys every message is new: the meta rows by one INSERT as
        -- table_push()'s, and the meta_opt rows of those with an expiry or an ordering key from the ids
        -- it returns, instead of the statement below, whose CTEs store every row. unnest() in a select
        -- list: two arrays of different lengths give NULLs for the shorter, so no ordering keys give okey
        -- NULL; and the RETURNING rows come in the order of the rows inserted, which is payload order.
        RETURN QUERY
        WITH m AS (
            INSERT INTO {schema}.meta (id, queue_id, state, priority, attempts, process_at, enqueued_at,
                lease_until, consumer, last_error, deliveries, payload, gen)
            SELECT y.id, p_queue_id, 0::smallint, p_priority, 0, v_at, now(),
                   NULL::timestamptz, NULL::text, NULL::text, 0, y.payload, ((y.id >> 14) & 7)::smallint
            FROM (SELECT nextval('{schema}.message_id_seq') AS id, x.payload
                  FROM (SELECT unnest(p_payloads) AS payload) x) y
            RETURNING id
        ), o AS (
            INSERT INTO {schema}.meta_opt (queue_id, id, priority, process_at, expires_at, okey)
            SELECT p_queue_id, k.id, p_priority, v_at, v_expires, k.okey
            FROM (SELECT unnest(ARRAY(SELECT m.id FROM m)) AS id,
                         unnest(coalesce(p_okeys, ARRAY[]::text[])) AS okey) k
            WHERE v_expires IS NOT NULL OR k.okey IS NOT NULL
        )
        SELECT m.id, true FROM m;
        RETURN;
    END IF;
    RETURN QUERY
    WITH input AS MATERIALIZED (
        SELECT nextval('{schema}.message_id_seq') AS id, p.payload, p.dedup_key, p.okey, p.ord
        FROM unnest(p_payloads, coalesce(p_keys, ARRAY[]::text[]), coalesce(p_okeys, ARRAY[]::text[]))
             WITH ORDINALITY AS p(payload, dedup_key, okey, ord)
    ), claimed AS (
        INSERT INTO {schema}.dedup AS d (queue_id, dedup_key, id, pushed_at)
        SELECT p_queue_id, i.dedup_key, i.id, now() FROM input i WHERE p_keys IS NOT NULL ORDER BY i.dedup_key
        ON CONFLICT (queue_id, dedup_key) DO UPDATE
        SET id = CASE WHEN d.pushed_at <= now() - make_interval(secs => v_window) THEN excluded.id ELSE d.id END,
            pushed_at = CASE WHEN d.pushed_at <= now() - make_interval(secs => v_window)
                             THEN excluded.pushed_at ELSE d.pushed_at END
        RETURNING d.dedup_key, d.id
    ), result AS MATERIALIZED (
        SELECT i.ord, i.payload, i.okey, coalesce(c.id, i.id) AS id, c.id IS NULL OR c.id = i.id AS new
        FROM input i LEFT JOIN claimed c ON c.dedup_key = i.dedup_key
    ), m AS (
        INSERT INTO {schema}.meta (id, queue_id, priority, process_at, enqueued_at, payload, gen)
        SELECT r.id, p_queue_id, p_priority, v_at, now(),
               CASE WHEN octet_length(r.payload) <= 1900 THEN r.payload END, ((r.id >> 14) & 7)::smallint
        FROM result r WHERE r.new
    ), o AS (
        INSERT INTO {schema}.meta_opt (queue_id, id, priority, process_at, expires_at, okey)
        SELECT p_queue_id, r.id, p_priority, v_at, v_expires, r.okey
        FROM result r WHERE r.new AND (v_expires IS NOT NULL OR r.okey IS NOT NULL)
    ), dd AS (
        INSERT INTO {schema}.data (id, queue_id, payload, gen)
        SELECT r.id, p_queue_id, r.payload, ((r.id >> 14) & 7)::smallint FROM result r
        WHERE r.new AND octet_length(r.payload) > 1900
    ), n AS (
        SELECT pg_notify(p_channel, '') AS sent
        WHERE v_notify > 0 AND EXISTS (SELECT 1 FROM result r WHERE r.new) AND (v_notify = 2 OR (
            SELECT r.id FROM {schema}.meta r
            WHERE r.gen = {schema}.table_generation() AND r.queue_id = p_queue_id AND r.state = 0
              AND r.process_at <= now() AND r.process_at >= v_floor
            ORDER BY r.priority, r.process_at DESC, r.id DESC
            LIMIT 1) IS NULL)
    )
    SELECT r.id, r.new FROM result r CROSS JOIN (SELECT count(*) AS c FROM n) x ORDER BY r.ord;
END
$$;

-- The table design's stats of queue p_queue_id (queries/table.sql's stats): its messages ready, delayed,
-- in flight, failed and finished (kept for the archiver), and the age of its oldest ready message. Each
-- is counted on its own index (the ready, leased and failed indexes of meta, done_queue_idx of done) up
-- to p_cap entries, so that a queue's stats read what that queue holds, and at most p_cap entries a
-- state. Each index is read backwards, from its newest entries: the entries of messages taken since
-- the last VACUUM (popped, acked, archived) lie at the other end, where a count from the oldest entry
-- would pass them all before the first one it counts (as table_push's check, see there), and the
-- delayed messages lie after the ready ones of their priority. A state with p_cap messages or more is estimated instead (r_estimated): from a sample of about
-- 1,000 pages of the table (TABLESAMPLE SYSTEM), the queue's rows in that state scaled to the whole,
-- never below p_cap; the oldest ready age then comes from the first 100 ready messages of each priority
-- in claim order (a loose scan over the priorities), which misses an older message only when a nack or
-- a delay put it behind younger ones. Generic plans (planned once a session: the statement has 40 scans
-- of partitions to plan), no sequential scans but the sample's.
CREATE OR REPLACE FUNCTION {schema}.table_stats(p_queue_id integer, p_cap bigint)
RETURNS TABLE (r_ready bigint, r_delayed bigint, r_in_flight bigint, r_failed bigint, r_finished bigint,
               r_oldest_ready_age_s double precision, r_estimated boolean)
LANGUAGE plpgsql STABLE SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
DECLARE
    v_ready bigint;
    v_delayed bigint;
    v_in_flight bigint;
    v_failed bigint;
    v_finished bigint;
    v_oldest timestamptz;
    v_pct double precision;
    v_est boolean;
    e_ready bigint;
    e_delayed bigint;
    e_in_flight bigint;
    e_failed bigint;
    e_finished bigint;
BEGIN
    SELECT count(*) INTO v_ready FROM (
        SELECT 1 FROM {schema}.meta WHERE queue_id = p_queue_id AND state = 0 AND process_at <= now()
        ORDER BY priority, process_at DESC, id DESC LIMIT p_cap) x;
    SELECT count(*) INTO v_delayed FROM (
        SELECT 1 FROM {schema}.meta WHERE queue_id = p_queue_id AND state = 0 AND process_at > now()
        ORDER BY priority, process_at DESC, id DESC LIMIT p_cap) x;
    SELECT count(*) INTO v_in_flight FROM (
        SELECT 1 FROM {schema}.meta WHERE queue_id = p_queue_id AND state = 1
        ORDER BY lease_until DESC LIMIT p_cap) x;
    SELECT count(*) INTO v_failed FROM (
        SELECT 1 FROM {schema}.meta WHERE queue_id = p_queue_id AND state = 2 ORDER BY id DESC LIMIT p_cap) x;
    SELECT count(*) INTO v_finished FROM (
        SELECT 1 FROM {schema}.done WHERE queue_id = p_queue_id ORDER BY finished_at DESC LIMIT p_cap) x;
    v_est := greatest(v_ready, v_delayed, v_in_flight, v_failed, v_finished) >= p_cap;
    IF NOT v_est THEN
        SELECT min(enqueued_at) INTO v_oldest FROM {schema}.meta
        WHERE queue_id = p_queue_id AND state = 0 AND process_at <= now();
    ELSE
        IF greatest(v_ready, v_delayed, v_in_flight, v_failed) >= p_cap THEN
            SELECT least(100, 100.0 * 1000 * current_setting('block_size')::integer
                              / greatest(sum(pg_relation_size(i.inhrelid)), 1)) INTO v_pct
            FROM pg_inherits i WHERE i.inhparent = '{schema}.meta'::regclass;
            SELECT count(*) FILTER (WHERE m.state = 0 AND m.process_at <= now()) * 100 / v_pct,
                   count(*) FILTER (WHERE m.state = 0 AND m.process_at > now()) * 100 / v_pct,
                   count(*) FILTER (WHERE m.state = 1) * 100 / v_pct,
                   count(*) FILTER (WHERE m.state = 2) * 100 / v_pct
            INTO e_ready, e_delayed, e_in_flight, e_failed
            FROM {schema}.meta m TABLESAMPLE SYSTEM (v_pct) WHERE m.queue_id = p_queue_id;
            IF v_ready >= p_cap THEN v_ready := greatest(p_cap, e_ready); END IF;
            IF v_delayed >= p_cap THEN v_delayed := greatest(p_cap, e_delayed); END IF;
            IF v_in_flight >= p_cap THEN v_in_flight := greatest(p_cap, e_in_flight); END IF;
            IF v_failed >= p_cap THEN v_failed := greatest(p_cap, e_failed); END IF;
        END IF;
        IF v_finished >= p_cap THEN
            SELECT least(100, 100.0 * 1000 * current_setting('block_size')::integer
                              / greatest(sum(pg_relation_size(i.inhrelid)), 1)) INTO v_pct
            FROM pg_inherits i WHERE i.inhparent = '{schema}.done'::regclass;
            SELECT count(*) * 100 / v_pct INTO e_finished
            FROM {schema}.done d TABLESAMPLE SYSTEM (v_pct) WHERE d.queue_id = p_queue_id;
            v_finished := greatest(p_cap, e_finished);
        END IF;
        WITH RECURSIVE p AS (
            (SELECT m.priority FROM {schema}.meta m WHERE m.queue_id = p_queue_id AND m.state = 0
             ORDER BY m.priority DESC LIMIT 1)
            UNION ALL
            SELECT (SELECT m.priority FROM {schema}.meta m
                    WHERE m.queue_id = p_queue_id AND m.state = 0 AND m.priority < p.priority
                    ORDER BY m.priority DESC LIMIT 1)
            FROM p WHERE p.priority IS NOT NULL
        )
        SELECT min(h.oldest) INTO v_oldest FROM p CROSS JOIN LATERAL (
            SELECT min(f.enqueued_at) AS oldest FROM (
                SELECT m.enqueued_at FROM {schema}.meta m
                WHERE m.queue_id = p_queue_id AND m.state = 0 AND m.priority = p.priority
                  AND m.process_at <= now()
                ORDER BY m.process_at, m.id LIMIT 100) f) h
        WHERE p.priority IS NOT NULL;
    END IF;
    RETURN QUERY SELECT v_ready, v_delayed, v_in_flight, v_failed, v_finished,
        extract(epoch FROM now() - v_oldest)::float8, v_est;
END
$$;

-- The payload of message p_id of generation p_gen in data, deleted with its row: a pop at most once
-- without the archive calls it for each message it takes whose payload is not in its meta row. The
-- generation names the one partition to probe.
CREATE OR REPLACE FUNCTION {schema}.data_take_of(p_id bigint, p_gen smallint) RETURNS bytea
LANGUAGE sql VOLATILE AS $$
    DELETE FROM {schema}.data WHERE id = p_id AND gen = p_gen RETURNING payload
$$;

-- The table design's pop at most once (and exactly once, in the caller's transaction): up to p_n ready
-- messages of queue p_queue_id in claim order (priority DESC, process_at, id), skipping rows other pops
-- hold, locked and deleted by one statement; kept in done for the archiver (p_archive), or deleted with
-- their payloads. attempts and deliveries come back counting this delivery. A payload in data is read
-- by id and generation (a scalar subquery, or data_take_of()), never by a join (see pop_lease in queries/table.sql).
-- A function with generic plans: its statements are planned once a session, not on every pop (custom
-- plans cost 0.12-0.22 ms of planning a call). No sequential or bitmap scans: the claim walks
-- meta_ready_idx in claim order and payloads are probed by id, whatever the statistics said when the
-- plan was made (a queue's are often those of an empty table).
-- The rows come back in claim order without a sort: the claim yields them in index order, the join
-- visits them in that order (a nested loop probing each row by its ctid; hash and merge joins are off,
-- so no other join can be chosen), and DELETE ... RETURNING returns each row as it deletes it. (Sorting
-- the returned rows again cost about 3,000 instructions a message at batch 100.)
-- The claim is bounded below by the queue's floor (process_at >= table_floor(), read once a call): no
-- ready row is below it, so the bound loses nothing, and on a server with skip scans (PostgreSQL 18)
-- each partition's walk of meta_ready_idx starts at it, past the entries of the messages popped below it
-- since the last VACUUM. The other claims (table_lease, the _with forms, claim_batch) and the looks at
-- what is ready (peek, count_ready, ready_head) are bounded alike.
CREATE OR REPLACE FUNCTION {schema}.table_take(p_queue_id integer, p_n integer, p_archive boolean)
RETURNS TABLE (r_id bigint, r_priority smallint, r_attempts integer, r_deliveries integer,
               r_enqueued_at timestamptz, r_lease_until timestamptz, r_payload bytea)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
SET enable_bitmapscan = off SET enable_hashjoin = off SET enable_mergejoin = off AS $$
DECLARE
    v_floor timestamptz := {schema}.table_floor(p_queue_id);
BEGIN
    IF p_archive THEN
        RETURN QUERY
        WITH taken AS (
            DELETE FROM {schema}.meta m
            USING (
                SELECT s.gen, s.ctid AS tid FROM {schema}.meta s
                WHERE s.queue_id = p_queue_id AND s.state = 0 AND s.process_at <= now() AND s.process_at >= v_floor
                ORDER BY s.priority DESC, s.process_at, s.id
                LIMIT p_n
                FOR UPDATE SKIP LOCKED) c
            WHERE m.gen = c.gen AND m.ctid = c.tid
            RETURNING m.id, m.queue_id, m.priority, m.attempts + 1 AS attempts,
                      m.deliveries + 1 AS deliveries, m.enqueued_at, m.payload, m.gen
        ), kept AS (
            INSERT INTO {schema}.done (id, queue_id, priority, attempts, enqueued_at, outcome, payload, gen)
            SELECT t.id, t.queue_id, t.priority, t.attempts, t.enqueued_at, 1, t.payload, t.gen FROM taken t
        )
        SELECT t.id, t.priority, t.attempts, t.deliveries, t.enqueued_at, NULL::timestamptz,
               coalesce(t.payload, (SELECT d.payload FROM {schema}.data d WHERE d.id = t.id AND d.gen = t.gen))
        FROM taken t;
    ELSE
        -- Rows straight from the DELETE: a CTE would copy each into a store and read it back (about
        -- 3,400 instructions a message at batch 100). A payload in data is taken (read and deleted) by
        -- data_take_of(), which coalesce() calls only for a row without a payload of its own.
        RETURN QUERY
        DELETE FROM {schema}.meta m
        USING (
            SELECT s.gen, s.ctid AS tid FROM {schema}.meta s
            WHERE s.queue_id = p_queue_id AND s.state = 0 AND s.process_at <= now() AND s.process_at >= v_floor
            ORDER BY s.priority DESC, s.process_at, s.id
            LIMIT p_n
            FOR UPDATE SKIP LOCKED) c
        WHERE m.gen = c.gen AND m.ctid = c.tid
        RETURNING m.id, m.priority, m.attempts + 1, m.deliveries + 1, m.enqueued_at, NULL::timestamptz,
                  coalesce(m.payload, {schema}.data_take_of(m.id, m.gen));
    END IF;
END
$$;

-- The table design's pop at least once: up to p_n ready messages of queue p_queue_id in claim order,
-- skipping rows other pops hold, leased to p_consumer for p_vt seconds, by one statement. Generic
-- plans, without sequential or bitmap scans, and rows in claim order without a sort, as table_take().
CREATE OR REPLACE FUNCTION {schema}.table_lease(
    p_queue_id integer, p_n integer, p_vt double precision, p_consumer text)
RETURNS TABLE (r_id bigint, r_priority smallint, r_attempts integer, r_deliveries integer,
               r_enqueued_at timestamptz, r_lease_until timestamptz, r_payload bytea)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
SET enable_bitmapscan = off SET enable_hashjoin = off SET enable_mergejoin = off AS $$
DECLARE
    v_floor timestamptz := {schema}.table_floor(p_queue_id);
BEGIN
    -- Rows straight from the UPDATE, not through a CTE (see table_take).
    RETURN QUERY
    UPDATE {schema}.meta m
    SET state = 1, attempts = m.attempts + 1, deliveries = m.deliveries + 1, consumer = p_consumer,
        lease_until = now() + make_interval(secs => p_vt)
    FROM (
        SELECT s.gen, s.ctid AS tid FROM {schema}.meta s
        WHERE s.queue_id = p_queue_id AND s.state = 0 AND s.process_at <= now() AND s.process_at >= v_floor
        ORDER BY s.priority DESC, s.process_at, s.id
        LIMIT p_n
        FOR UPDATE SKIP LOCKED) c
    WHERE m.gen = c.gen AND m.ctid = c.tid
    RETURNING m.id, m.priority, m.attempts, m.deliveries, m.enqueued_at, m.lease_until,
              coalesce(m.payload, (SELECT d.payload FROM {schema}.data d WHERE d.id = m.id AND d.gen = m.gen));
END
$$;

-- table_take() for a queue whose messages may expire (p_expiring: created with a ttl) or that is
-- ordered per key (p_per_key). The client calls it only for such a queue, so that table_take()'s claim,
-- which every other queue's pops run, evaluates neither check. Besides the rows table_take() skips, it
-- skips rows whose time to live has passed (left to the expiry sweep) and rows whose ordering key has
-- an earlier message (a smaller id) ready, delayed or in flight: a meta_opt row of the key with a smaller
-- id (meta_opt_key_idx) whose meta row is not failed (meta_failed_idx); the rows of a take not committed
-- yet still count, as every other transaction still sees them. Each candidate with no meta_opt row costs
-- one probe of meta_opt_pkey. It deletes the meta_opt rows of what it takes. Otherwise as table_take():
-- generic plans, rows in claim order without a sort.
CREATE OR REPLACE FUNCTION {schema}.table_take_with(
    p_queue_id integer, p_n integer, p_archive boolean, p_expiring boolean, p_per_key boolean)
RETURNS TABLE (r_id bigint, r_priority smallint, r_attempts integer, r_deliveries integer,
               r_enqueued_at timestamptz, r_lease_until timestamptz, r_payload bytea)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
SET enable_bitmapscan = off SET enable_hashjoin = off SET enable_mergejoin = off AS $$
DECLARE
    v_floor timestamptz := {schema}.table_floor(p_queue_id);
BEGIN
    IF p_archive THEN
        RETURN QUERY
        WITH taken AS (
            DELETE FROM {schema}.meta m
            USING (
                SELECT s.gen, s.ctid AS tid FROM {schema}.meta s
                WHERE s.queue_id = p_queue_id AND s.state = 0 AND s.process_at <= now() AND s.process_at >= v_floor
                  AND NOT EXISTS (SELECT 1 FROM {schema}.meta_opt o
                      WHERE o.queue_id = s.queue_id AND o.id = s.id
                        AND ((p_expiring AND o.expires_at <= now())
                             OR (p_per_key AND o.okey IS NOT NULL AND EXISTS (SELECT 1 FROM {schema}.meta_opt e
                                 WHERE e.queue_id = o.queue_id AND e.okey = o.okey AND e.id < o.id
                                   AND NOT EXISTS (SELECT 1 FROM {schema}.meta f
                                       WHERE f.queue_id = e.queue_id AND f.id = e.id AND f.state = 2)))))
                ORDER BY s.priority DESC, s.process_at, s.id
                LIMIT p_n
                FOR UPDATE SKIP LOCKED) c
            WHERE m.gen = c.gen AND m.ctid = c.tid
            RETURNING m.id, m.queue_id, m.priority, m.attempts + 1 AS attempts,
                      m.deliveries + 1 AS deliveries, m.enqueued_at, m.payload, m.gen
        ), kept AS (
            INSERT INTO {schema}.done (id, queue_id, priority, attempts, enqueued_at, outcome, payload, gen)
            SELECT t.id, t.queue_id, t.priority, t.attempts, t.enqueued_at, 1, t.payload, t.gen FROM taken t
        ), opt AS (
            DELETE FROM {schema}.meta_opt o
            WHERE o.queue_id = p_queue_id AND o.id = ANY (ARRAY(SELECT t.id FROM taken t))
        )
        SELECT t.id, t.priority, t.attempts, t.deliveries, t.enqueued_at, NULL::timestamptz,
               coalesce(t.payload, (SELECT d.payload FROM {schema}.data d WHERE d.id = t.id AND d.gen = t.gen))
        FROM taken t;
    ELSE
        -- The meta_opt rows of the messages taken go with them (a CTE, which table_take() does without).
        -- A payload in data is taken (read and deleted) by data_take_of(), which coalesce() calls only
        -- for a row without a payload of its own.
        RETURN QUERY
        WITH taken AS (
            DELETE FROM {schema}.meta m
            USING (
                SELECT s.gen, s.ctid AS tid FROM {schema}.meta s
                WHERE s.queue_id = p_queue_id AND s.state = 0 AND s.process_at <= now() AND s.process_at >= v_floor
                  AND NOT EXISTS (SELECT 1 FROM {schema}.meta_opt o
                      WHERE o.queue_id = s.queue_id AND o.id = s.id
                        AND ((p_expiring AND o.expires_at <= now())
                             OR (p_per_key AND o.okey IS NOT NULL AND EXISTS (SELECT 1 FROM {schema}.meta_opt e
                                 WHERE e.queue_id = o.queue_id AND e.okey = o.okey AND e.id < o.id
                                   AND NOT EXISTS (SELECT 1 FROM {schema}.meta f
                                       WHERE f.queue_id = e.queue_id AND f.id = e.id AND f.state = 2)))))
                ORDER BY s.priority DESC, s.process_at, s.id
                LIMIT p_n
                FOR UPDATE SKIP LOCKED) c
            WHERE m.gen = c.gen AND m.ctid = c.tid
            RETURNING m.id, m.priority, m.attempts + 1 AS attempts, m.deliveries + 1 AS deliveries, m.enqueued_at,
                      coalesce(m.payload, {schema}.data_take_of(m.id, m.gen)) AS payload
        ), opt AS (
            DELETE FROM {schema}.meta_opt o
            WHERE o.queue_id = p_queue_id AND o.id = ANY (ARRAY(SELECT t.id FROM taken t))
        )
        SELECT t.id, t.priority, t.attempts, t.deliveries, t.enqueued_at, NULL::timestamptz, t.payload
        FROM taken t;
    END IF;
END
$$;

-- table_lease() for a queue whose messages may expire or that is ordered per key: it skips what
-- table_take_with() skips, and is otherwise table_lease().
CREATE OR REPLACE FUNCTION {schema}.table_lease_with(
    p_queue_id integer, p_n integer, p_vt double precision, p_consumer text, p_expiring boolean,
    p_per_key boolean)
RETURNS TABLE (r_id bigint, r_priority smallint, r_attempts integer, r_deliveries integer,
               r_enqueued_at timestamptz, r_lease_until timestamptz, r_payload bytea)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
SET enable_bitmapscan = off SET enable_hashjoin = off SET enable_mergejoin = off AS $$
DECLARE
    v_floor timestamptz := {schema}.table_floor(p_queue_id);
BEGIN
    -- Rows straight from the UPDATE, not through a CTE (see table_take).
    RETURN QUERY
    UPDATE {schema}.meta m
    SET state = 1, attempts = m.attempts + 1, deliveries = m.deliveries + 1, consumer = p_consumer,
        lease_until = now() + make_interval(secs => p_vt)
    FROM (
        SELECT s.gen, s.ctid AS tid FROM {schema}.meta s
        WHERE s.queue_id = p_queue_id AND s.state = 0 AND s.process_at <= now() AND s.process_at >= v_floor
          AND NOT EXISTS (SELECT 1 FROM {schema}.meta_opt o
              WHERE o.queue_id = s.queue_id AND o.id = s.id
                AND ((p_expiring AND o.expires_at <= now())
                     OR (p_per_key AND o.okey IS NOT NULL AND EXISTS (SELECT 1 FROM {schema}.meta_opt e
                         WHERE e.queue_id = o.queue_id AND e.okey = o.okey AND e.id < o.id
                           AND NOT EXISTS (SELECT 1 FROM {schema}.meta f
                               WHERE f.queue_id = e.queue_id AND f.id = e.id AND f.state = 2)))))
        ORDER BY s.priority DESC, s.process_at, s.id
        LIMIT p_n
        FOR UPDATE SKIP LOCKED) c
    WHERE m.gen = c.gen AND m.ctid = c.tid
    RETURNING m.id, m.priority, m.attempts, m.deliveries, m.enqueued_at, m.lease_until,
              coalesce(m.payload, (SELECT d.payload FROM {schema}.data d WHERE d.id = m.id AND d.gen = m.gen));
END
$$;

-- The table design's ack: finish the leased messages of the receipts (p_ids, p_deliveries), all or
-- nothing, without locking them first, as queries/table.sql's ack says; returns their ids. Generic plans,
-- without sequential or bitmap scans: each receipt probes meta_leased_id_idx, whatever the statistics.
CREATE OR REPLACE FUNCTION {schema}.table_ack(
    p_ids bigint[], p_deliveries integer[], p_queue_id integer, p_archive boolean)
RETURNS SETOF bigint
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
SET enable_bitmapscan = off SET enable_hashjoin = off SET enable_mergejoin = off AS $$
BEGIN
    IF p_archive THEN
        RETURN QUERY
        WITH acked AS (
            DELETE FROM {schema}.meta m
            USING (
                SELECT h.gen, h.tid
                FROM unnest(p_ids, p_deliveries) AS r(id, delivery)
                CROSS JOIN LATERAL (
                    SELECT s.gen, s.ctid AS tid FROM {schema}.meta s
                    WHERE s.id = r.id AND s.deliveries = r.delivery AND s.queue_id = p_queue_id
                      AND s.lease_until > now()
                    OFFSET 0) h) c
            WHERE m.gen = c.gen AND m.ctid = c.tid
            RETURNING m.id, m.queue_id, m.priority, m.attempts, m.enqueued_at, m.payload, m.gen
        ), kept AS (
            INSERT INTO {schema}.done (id, queue_id, priority, attempts, enqueued_at, outcome, payload, gen)
            SELECT a.id, a.queue_id, a.priority, a.attempts, a.enqueued_at, 1, a.payload, a.gen FROM acked a
        ), checked AS (
            SELECT CASE WHEN count(*) = cardinality(p_ids) THEN count(*)
                        ELSE {schema}.receipts_not_held(cardinality(p_ids), count(*)) END AS n
            FROM acked
        )
        SELECT a.id FROM acked a CROSS JOIN checked c;
    ELSE
        RETURN QUERY
        WITH acked AS (
            DELETE FROM {schema}.meta m
            USING (
                SELECT h.gen, h.tid
                FROM unnest(p_ids, p_deliveries) AS r(id, delivery)
                CROSS JOIN LATERAL (
                    SELECT s.gen, s.ctid AS tid FROM {schema}.meta s
                    WHERE s.id = r.id AND s.deliveries = r.delivery AND s.queue_id = p_queue_id
                      AND s.lease_until > now()
                    OFFSET 0) h) c
            WHERE m.gen = c.gen AND m.ctid = c.tid
            RETURNING m.id, m.payload
        ), dropped AS (
            DELETE FROM {schema}.data d
            WHERE d.id = ANY (ARRAY(SELECT a.id FROM acked a WHERE a.payload IS NULL))
        ), checked AS (
            SELECT CASE WHEN count(*) = cardinality(p_ids) THEN count(*)
                        ELSE {schema}.receipts_not_held(cardinality(p_ids), count(*)) END AS n
            FROM acked
        )
        SELECT a.id FROM acked a CROSS JOIN checked c;
    END IF;
END
$$;

-- table_ack() for a queue whose messages may expire or that is ordered per key (the client calls it only
-- for such a queue): the acked messages' meta_opt rows are deleted with their meta rows.
CREATE OR REPLACE FUNCTION {schema}.table_ack_with(
    p_ids bigint[], p_deliveries integer[], p_queue_id integer, p_archive boolean)
RETURNS SETOF bigint
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
SET enable_bitmapscan = off SET enable_hashjoin = off SET enable_mergejoin = off AS $$
BEGIN
    IF p_archive THEN
        RETURN QUERY
        WITH acked AS (
            DELETE FROM {schema}.meta m
            USING (
                SELECT h.gen, h.tid
                FROM unnest(p_ids, p_deliveries) AS r(id, delivery)
                CROSS JOIN LATERAL (
                    SELECT s.gen, s.ctid AS tid FROM {schema}.meta s
                    WHERE s.id = r.id AND s.deliveries = r.delivery AND s.queue_id = p_queue_id
                      AND s.lease_until > now()
                    OFFSET 0) h) c
            WHERE m.gen = c.gen AND m.ctid = c.tid
            RETURNING m.id, m.queue_id, m.priority, m.attempts, m.enqueued_at, m.payload, m.gen
        ), kept AS (
            INSERT INTO {schema}.done (id, queue_id, priority, attempts, enqueued_at, outcome, payload, gen)
            SELECT a.id, a.queue_id, a.priority, a.attempts, a.enqueued_at, 1, a.payload, a.gen FROM acked a
        ), opt AS (
            DELETE FROM {schema}.meta_opt o
            WHERE o.queue_id = p_queue_id AND o.id = ANY (ARRAY(SELECT a.id FROM acked a))
        ), checked AS (
            SELECT CASE WHEN count(*) = cardinality(p_ids) THEN count(*)
                        ELSE {schema}.receipts_not_held(cardinality(p_ids), count(*)) END AS n
            FROM acked
        )
        SELECT a.id FROM acked a CROSS JOIN checked c;
    ELSE
        RETURN QUERY
        WITH acked AS (
            DELETE FROM {schema}.meta m
            USING (
                SELECT h.gen, h.tid
                FROM unnest(p_ids, p_deliveries) AS r(id, delivery)
                CROSS JOIN LATERAL (
                    SELECT s.gen, s.ctid AS tid FROM {schema}.meta s
                    WHERE s.id = r.id AND s.deliveries = r.delivery AND s.queue_id = p_queue_id
                      AND s.lease_until > now()
                    OFFSET 0) h) c
            WHERE m.gen = c.gen AND m.ctid = c.tid
            RETURNING m.id, m.payload
        ), dropped AS (
            DELETE FROM {schema}.data d
            WHERE d.id = ANY (ARRAY(SELECT a.id FROM acked a WHERE a.payload IS NULL))
        ), opt AS (
            DELETE FROM {schema}.meta_opt o
            WHERE o.queue_id = p_queue_id AND o.id = ANY (ARRAY(SELECT a.id FROM acked a))
        ), checked AS (
            SELECT CASE WHEN count(*) = cardinality(p_ids) THEN count(*)
                        ELSE {schema}.receipts_not_held(cardinality(p_ids), count(*)) END AS n
            FROM acked
        )
        SELECT a.id FROM acked a CROSS JOIN checked c;
    END IF;
END
$$;

-- The table design's generations (schema.sql, before meta): the generation pushes write now, from the
-- message id sequence's last value (read without a lock and without a row version: a sequence is not
-- transactional).
CREATE OR REPLACE FUNCTION {schema}.table_generation() RETURNS smallint
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT ((s.last_value >> 14) & 7)::smallint FROM {schema}.message_id_seq s
$$;

-- The floor of a table-design queue: a time at or below the process-at time of every message of the
-- queue that is ready, delayed or leased (state 0 or 1), so that a claim, a peek or a count of ready
-- messages may start its walk of meta_ready_idx at it (process_at >= floor) instead of at the queue's
-- first entry, and pass no entry of the messages popped below it since the last VACUUM. Kept in a
-- sequence a queue, table_floor_<queue_id>, as microseconds since the epoch: a sequence is read
-- without a snapshot (a push under REPEATABLE READ sees the floor as it is now, not as its snapshot
-- had it) and set by setval() without a row version (a raise leaves no dead row under a held xmin
-- horizon). The sequence is made with the queue (table_make_floor), unset, and set by a raise
-- (table_raise_floors); it is owned by queues.queue_id, so that it goes with the schema's tables. A queue without one, or with one
-- not set yet, has no floor ('-infinity': its claims walk from the queue's first entry). Security
-- definer, its search_path pinned: roles read the floor through it without a grant on the sequence.
-- The invariant: every writer of a state-0 row keeps process_at >= floor. table_push and
-- table_push_with take the larger of their time and the floor, read after the queue's push lock
-- (taken shared, to the end of the transaction); requeue_failed does the same (table_floor_locked); a
-- nack takes the larger of its time and the message's own process-at time, and a reclaimed lease keeps
-- its own: a leased message is counted by every raise, so its time is never below the floor. A move to
-- another generation keeps the time. A raise is made only under the queue's push lock taken
-- exclusively (table_raise_floors), so no writer is between its read of the floor and its commit then.
CREATE OR REPLACE FUNCTION {schema}.table_floor(p_queue_id integer) RETURNS timestamptz
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT coalesce(timestamptz 'epoch'
                    + pg_sequence_last_value(to_regclass('{schema}.table_floor_' || p_queue_id))
                      * interval '1 microsecond',
                    timestamptz '-infinity')
$$;

-- The floor of queue p_queue_id for a writer of a ready message that does not push: the queue's push
-- lock is taken shared first (to the end of the transaction), so no raise comes between this read and
-- the writer's commit (requeue_failed).
CREATE OR REPLACE FUNCTION {schema}.table_floor_locked(p_queue_id integer) RETURNS timestamptz
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_locked text;
BEGIN
    v_locked := pg_advisory_xact_lock_shared(hashtext('dbqueue.queue.' || '{schema}'), p_queue_id)::text;
    RETURN {schema}.table_floor(p_queue_id);
END
$$;

-- Make the floor sequence of table-design queue p_queue_id (table_floor), unset (no floor yet), unless it
-- exists: create_queue calls it in the transaction that inserts the queue's row, so the sequence is there
-- before any push can name the queue (a queue of an install before the floor gets its sequence from
-- table_raise_floors). A relation of that name that is not the engine's (not a sequence owned by
-- queues.queue_id, as the one made here is) is refused with DQ006 (ForeignObjectsError), and the
-- queue's creation with it: table_floor would read it as the queue's floor, and a raise would set it.
-- Security definer: a role that may create queues needs no right to create objects in the schema; its
-- search_path pinned.
CREATE OR REPLACE FUNCTION {schema}.table_make_floor(p_queue_id integer) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_rel regclass := to_regclass('{schema}.table_floor_' || p_queue_id);
BEGIN
    IF v_rel IS NULL THEN
        EXECUTE format('CREATE SEQUENCE %s.%I AS bigint MINVALUE %s OWNED BY %s.queues.queue_id',
                       '{schema}', 'table_floor_' || p_queue_id, -9223372036854775807, '{schema}');
    ELSIF NOT EXISTS (SELECT 1 FROM pg_class c JOIN pg_depend d ON d.objid = c.oid
                      WHERE c.oid = v_rel AND c.relkind = 'S'
                        AND d.classid = 'pg_class'::regclass AND d.deptype = 'a'
                        AND d.refclassid = 'pg_class'::regclass AND d.refobjid = '{schema}.queues'::regclass) THEN
        RAISE EXCEPTION 'the schema holds a relation named % that the engine did not make', v_rel
            USING ERRCODE = 'DQ006',
                  DETAIL = format('%s would be read as the floor of queue %s: drop or rename it, then create '
                                  'the queue again', v_rel, p_queue_id);
    END IF;
END
$$;

-- Raise the floor of every table-design queue whose push lock can be taken exclusively now (tried, never
-- waited for: a queue with a push in progress keeps its floor until the next raise). Under the lock (a
-- session lock, let go as soon as the queue's floor is set, so pushes wait only for that) no push,
-- requeue or drop of the queue is in progress, and each statement's snapshot is taken after the lock
-- was granted: the new floor is the least process-at time of the queue's ready, delayed and leased
-- rows in it, and never later than now(). Rows a pop, a lease or a reclaim has changed but not yet
-- committed are seen as they were, so a rollback brings back only rows the raise counted; a nack in
-- progress is seen as its lease. A queue without its floor sequence (created by an install before the
-- floor) gets one here and its first raise in a later call. The ready rows are found from the old floor up, one index probe a
-- priority (a loose scan over meta_ready_idx: nothing of the queue's is below the old floor), so a
-- raise passes only what was popped since the last one; the leased rows through meta_leased_idx. The
-- floor never goes down. Then the floor sequences of dropped queues are dropped. Returns how many
-- floors were raised. Security definer (it changes no message, and makes and drops only the engine's
-- floor sequences), its search_path pinned; no sequential scans (a queue's statistics are often an
-- empty table's).
CREATE OR REPLACE FUNCTION {schema}.table_raise_floors() RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET enable_seqscan = off AS $$
DECLARE
    q integer;
    v_old timestamptz;
    v_new timestamptz;
    v_raised integer := 0;
    v_made integer[] := ARRAY[]::integer[];
    v_seq text;
BEGIN
    -- Each statement below must see what committed before the queue's lock was granted, as only READ
    -- COMMITTED gives it (a transaction snapshot may be older than the lock, and miss a push's rows).
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'table_raise_floors runs in a READ COMMITTED transaction of its own'
            USING ERRCODE = 'invalid_transaction_state';
    END IF;
    -- A queue without its sequence gets one, and its first raise in a later call: a push that found no
    -- sequence (no floor) may still be in progress until this transaction commits, and only a raise
    -- made after that, under the queue's lock, can be sure every such push committed.
    FOR q IN SELECT x.queue_id FROM {schema}.queues x
             WHERE x.design = 'table' AND to_regclass('{schema}.table_floor_' || x.queue_id) IS NULL LOOP
        BEGIN
            PERFORM {schema}.table_make_floor(q);
        EXCEPTION WHEN duplicate_table OR unique_violation THEN
            NULL;  -- another raise made it meanwhile
        END;
        v_made := array_append(v_made, q);
    END LOOP;
    FOR q IN SELECT x.queue_id FROM {schema}.queues x
             WHERE x.design = 'table' AND NOT x.queue_id = ANY (v_made) ORDER BY x.queue_id LOOP
        CONTINUE WHEN NOT pg_try_advisory_lock(hashtext('dbqueue.queue.' || '{schema}'), q);
        BEGIN
            v_old := {schema}.table_floor(q);
            WITH RECURSIVE p(priority, at) AS (
                (SELECT s.priority, s.process_at FROM {schema}.meta s
                 WHERE s.queue_id = q AND s.state = 0 AND s.process_at >= v_old
                 ORDER BY s.priority DESC, s.process_at, s.id
                 LIMIT 1)
                UNION ALL
                SELECT n.priority, n.at FROM p CROSS JOIN LATERAL (
                    SELECT s.priority, s.process_at AS at FROM {schema}.meta s
                    WHERE s.queue_id = q AND s.state = 0 AND s.priority < p.priority AND s.process_at >= v_old
                    ORDER BY s.priority DESC, s.process_at, s.id
                    LIMIT 1) n
            )
            SELECT greatest(v_old, least(now(), (SELECT min(p.at) FROM p),
                                         (SELECT min(l.process_at) FROM {schema}.meta l
                                          WHERE l.queue_id = q AND l.state = 1)))
            INTO v_new;
            IF v_new > v_old AND EXISTS (SELECT 1 FROM {schema}.queues x WHERE x.queue_id = q) THEN
                PERFORM setval(('{schema}.table_floor_' || q)::regclass,
                               (extract(epoch FROM v_new) * 1000000)::bigint, true);
                v_raised := v_raised + 1;
            END IF;
        EXCEPTION WHEN OTHERS OR query_canceled THEN  -- the session lock must not outlive the call
            PERFORM pg_advisory_unlock(hashtext('dbqueue.queue.' || '{schema}'), q);
            RAISE;
        END;
        PERFORM pg_advisory_unlock(hashtext('dbqueue.queue.' || '{schema}'), q);
    END LOOP;
    FOR v_seq IN
        SELECT c.relname FROM pg_class c
        WHERE c.relnamespace = '{schema}'::regnamespace AND c.relkind = 'S' AND c.relname LIKE 'table\_floor\_%'
          AND NOT EXISTS (SELECT 1 FROM {schema}.queues x WHERE 'table_floor_' || x.queue_id = c.relname)
          -- only the engine's own: made OWNED BY queues.queue_id (table_make_floor), not a sequence of
          -- someone else's that happens to be named so in this schema
          AND EXISTS (SELECT 1 FROM pg_depend d
                      WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid AND d.deptype = 'a'
                        AND d.refclassid = 'pg_class'::regclass AND d.refobjid = '{schema}.queues'::regclass)
    LOOP
        EXECUTE format('DROP SEQUENCE IF EXISTS %s.%I', '{schema}', v_seq);
    END LOOP;
    RETURN v_raised;
END
$$;

-- Move up to p_limit messages that would keep an old generation's partitions from emptying into the
-- generation pushes write now: messages delayed past the next second (delayed pushes, nacked ones
-- waiting out their backoff) and failed messages. The generation pushes write now and the one before it
-- (whose ready messages consumers are still taking) are left alone. A move is an UPDATE of gen (the row
-- goes to the other partition under the same id and deliveries, so receipts and batches still name it),
-- and the message's payload row in data moves with it. Only rows no pop can claim are moved: a claim
-- reads state 0 and process_at <= now(), and a transaction's now() is never later than the clock, so
-- no pop meets a row while it moves (it would fail with "moved to another partition due to concurrent
-- update"). Leased messages are not moved (an ack or nack may be on its way to them): a lease pins its
-- partition until it is acked, nacked or expires. Rows other sessions hold are skipped, and so are the
-- rows of a queue being dropped: a move takes the queue's push lock in shared mode (without waiting),
-- which drop_queue takes exclusively, so a drop never meets a row that moved under it. Returns how many
-- moved. Security definer (moving needs no grant of the caller's: it changes no message's meaning), its
-- search_path pinned.
CREATE OR REPLACE FUNCTION {schema}.table_move_stragglers(p_limit integer) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_now smallint := {schema}.table_generation();
    v_moved integer := 0;
    v_ids bigint[];
    g smallint;
BEGIN
    FOR g IN SELECT x::smallint FROM generate_series(0, 7) AS x LOOP
        CONTINUE WHEN g = v_now OR g = (v_now + 7) % 8;
        EXIT WHEN v_moved >= p_limit;
        WITH moved AS (
            UPDATE {schema}.meta m SET gen = v_now
            FROM (
                SELECT s.gen, s.ctid AS tid FROM {schema}.meta s
                WHERE s.gen = g
                  AND (s.state = 2 OR (s.state = 0 AND s.process_at > clock_timestamp() + interval '1 second'))
                  AND pg_try_advisory_xact_lock_shared(hashtext('dbqueue.queue.' || '{schema}'), s.queue_id)
                LIMIT p_limit - v_moved
                FOR UPDATE SKIP LOCKED) c
            WHERE m.gen = c.gen AND m.ctid = c.tid
            RETURNING m.id, m.payload IS NULL AS in_data
        )
        SELECT coalesce(array_agg(id) FILTER (WHERE in_data), ARRAY[]::bigint[]), v_moved + count(*)
        INTO v_ids, v_moved FROM moved;
        IF cardinality(v_ids) > 0 THEN
            UPDATE {schema}.data d SET gen = v_now WHERE d.gen = g AND d.id = ANY (v_ids);
        END IF;
    END LOOP;
    RETURN v_moved;
END
$$;

-- Empty partition gen p_gen of the table design's table p_table (meta, data or done) when it holds no
-- row: TRUNCATE, which takes its dead row versions and index entries with it at once, also while the
-- xmin horizon is held (VACUUM cannot remove them then). The partition is checked without a lock first,
-- then locked ACCESS EXCLUSIVE within p_lock_timeout_ms and checked again under the lock (a push or a
-- move may have written it in between: the check's fresh snapshot sees what committed before the lock
-- was granted, and nothing can write it while the lock is held). Returns the milliseconds from the
-- lock's grant to the end of the TRUNCATE when it was emptied (the lock is held that long, and until the
-- transaction commits), -1 when it holds a row, NULL when the lock was not granted in time (pops and
-- pushes hold it; queued behind the request they wait at most p_lock_timeout_ms). Run it in a
-- transaction of its own, which should end at once. TRUNCATE is not MVCC-safe: a transaction whose
-- snapshot is older than the TRUNCATE and that had not read the partition before sees it empty. Such a
-- reader misses only rows that no statement may take any more (every row it would have seen was
-- finished, or moved to a newer partition, by a transaction that committed before the TRUNCATE): a pop
-- would have failed to claim them (under REPEATABLE READ with a serialization error), a count or a peek
-- is short by them. A transaction that read the partition holds a lock on it until it ends, so the
-- TRUNCATE waits for it (and gives up after p_lock_timeout_ms). Security definer: the caller needs no
-- right to truncate (it loses nothing, as the partition holds no row); its search_path pinned.
CREATE OR REPLACE FUNCTION {schema}.table_empty_partition(p_table text, p_gen integer, p_lock_timeout_ms integer)
RETURNS double precision
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_part text;
    v_found boolean;
    v_granted timestamptz;
BEGIN
    IF p_table NOT IN ('meta', 'data', 'done') OR p_gen NOT BETWEEN 0 AND 7 THEN
        RAISE EXCEPTION 'no partition % of %', p_gen, p_table USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'table_empty_partition runs in a READ COMMITTED transaction of its own'
            USING ERRCODE = 'invalid_transaction_state';
    END IF;
    -- One emptying of a generation's partitions at a time: two emptyings of one partition would each
    -- hold the share lock of their first check while asking for the exclusive one, and deadlock. The
    -- second returns as if the lock was not granted, and its next run tries again.
    IF NOT pg_try_advisory_xact_lock(hashtext('dbqueue.recycle.' || '{schema}'), p_gen) THEN
        RETURN NULL;
    END IF;
    v_part := format('%s.%I', '{schema}', p_table || '_' || p_gen);
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM ONLY %s)', v_part) INTO v_found;
    IF v_found THEN
        RETURN -1;
    END IF;
    PERFORM set_config('lock_timeout', p_lock_timeout_ms::text, true);
    BEGIN
        EXECUTE format('LOCK TABLE ONLY %s IN ACCESS EXCLUSIVE MODE', v_part);
    EXCEPTION WHEN lock_not_available THEN
        RETURN NULL;
    END;
    v_granted := clock_timestamp();
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM ONLY %s)', v_part) INTO v_found;
    IF v_found THEN
        RETURN -1;
    END IF;
    EXECUTE format('TRUNCATE ONLY %s', v_part);
    RETURN extract(epoch FROM clock_timestamp() - v_granted) * 1000;
END
$$;

-- Create a ring: its push sequence (CACHE 1: a cached number is invisible to the gap proof below),
-- its gap counter, its header row, its lanes and capacity empty slots. Slot j starts as if it held the
-- last number <= 0 that maps to it, so number j + k * capacity finds its predecessor written and below
-- every lane's first position. Lane k starts at the first number of the lane (k, or p_lanes for lane 0).
-- The slots are first written with a filler of 5/4 p_slot_bytes and then emptied: that fixes how many
-- slots share a page (half a page of fillers at fillfactor 50), so that every slot of a page can take a
-- full new version beside its current one and updates stay HOT. With fillers of p_slot_bytes a ring's
-- heap grew in its first wraps until enough slots had moved to new pages (to 1.22-1.27x, then flat to
-- 10M messages); with 5/4 it starts at 1.08x that first size and stayed within 1.02x of it in
-- 150,000-message soaks on a quiet machine.
CREATE OR REPLACE FUNCTION {schema}.ring_create(
    p_schema text, p_queue_id integer, p_capacity integer, p_slot_bytes integer, p_lanes integer)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_seq text := format('%I.%I', p_schema, 'ring_' || p_queue_id || '_seq');
    v_gaps text := format('%I.%I', p_schema, 'ring_' || p_queue_id || '_gaps');
BEGIN
    EXECUTE format('CREATE SEQUENCE %s AS bigint MINVALUE 1 CACHE 1', v_seq);
    EXECUTE format('CREATE SEQUENCE %s AS bigint MINVALUE 1 CACHE 1', v_gaps);
    INSERT INTO {schema}.rings (queue_id, capacity, push_seq, gap_seq, lanes)
    VALUES (p_queue_id, p_capacity, v_seq::regclass, v_gaps::regclass, p_lanes);
    INSERT INTO {schema}.ring_lanes (queue_id, lane, pos)
    SELECT p_queue_id, k, CASE WHEN k = 0 THEN p_lanes ELSE k END FROM generate_series(0, p_lanes - 1) AS k;
    INSERT INTO {schema}.ring_slots (queue_id, slot, seq, payload)
    SELECT p_queue_id, g, CASE WHEN g = 0 THEN 0 ELSE g - p_capacity END,
           decode(repeat('00', p_slot_bytes * 5 / 4), 'hex')
    FROM generate_series(0, p_capacity - 1) AS g;
    UPDATE {schema}.ring_slots SET payload = NULL WHERE queue_id = p_queue_id;
END
$$;

CREATE OR REPLACE FUNCTION {schema}.ring_drop(p_queue_id integer)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_seq regclass;
    v_gaps regclass;
BEGIN
    DELETE FROM {schema}.rings WHERE queue_id = p_queue_id RETURNING push_seq, gap_seq INTO v_seq, v_gaps;
    DELETE FROM {schema}.ring_slots WHERE queue_id = p_queue_id;
    DELETE FROM {schema}.ring_lanes WHERE queue_id = p_queue_id;
    DELETE FROM {schema}.ring_leases WHERE queue_id = p_queue_id;
    DELETE FROM {schema}.ring_retry WHERE queue_id = p_queue_id;
    DELETE FROM {schema}.ring_failed WHERE queue_id = p_queue_id;
    PERFORM {schema}.ring_drop_group(p_queue_id, g.gid) FROM {schema}.ring_groups g WHERE g.queue_id = p_queue_id;
    PERFORM {schema}.ring_rows_drop(p_queue_id);
    IF v_seq IS NOT NULL THEN
        EXECUTE format('DROP SEQUENCE IF EXISTS %s, %s', v_seq, v_gaps);
    END IF;
END
$$;

-- Add a consumer group to a ring: its row in ring_groups (a new gid, from group_gids) and
-- lanes of its own. p_earliest: each lane starts at the lowest position of that lane over the ring's
-- groups (the group sees every message that some group has not taken yet; messages that other groups
-- hold leased or to deliver again are theirs alone); otherwise at the first number of the lane past the
-- push position (the group sees what is pushed from now on). Either way each new lane starts at or
-- above a lane of the same numbers that holds the floor up already, so the floor does not go down
-- (pushes of one rely on a floor read earlier): the ring's lanes are locked meanwhile, so that none of
-- them moves on and lets a push overwrite a number the new group starts below. Returns the gid, or NULL
-- when the ring does not exist; a name taken raises unique_violation (ring_groups_name_key).
CREATE OR REPLACE FUNCTION {schema}.ring_add_group(
    p_queue_id integer, p_name text, p_earliest boolean, p_on_lag smallint, p_lag_timeout_s double precision)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    v_lanes integer;
    v_gid integer;
    v_issued bigint;
BEGIN
    SELECT r.lanes, coalesce(pg_sequence_last_value(r.push_seq), 0) INTO v_lanes, v_issued
    FROM {schema}.rings r WHERE r.queue_id = p_queue_id FOR UPDATE;
    IF NOT FOUND THEN  -- a ring of the rows layout, or none
        RETURN {schema}.ring_rows_add_group(p_queue_id, p_name, p_earliest, p_on_lag, p_lag_timeout_s);
    END IF;
    PERFORM 1 FROM {schema}.ring_lanes t
    WHERE t.queue_id = p_queue_id
       OR t.queue_id IN (SELECT g.gid FROM {schema}.ring_groups g WHERE g.queue_id = p_queue_id)
    ORDER BY t.queue_id, t.lane FOR UPDATE;
    v_gid := -nextval('{schema}.group_gids')::integer;
    INSERT INTO {schema}.ring_groups (queue_id, gid, name, on_lag, lag_timeout_s)
    VALUES (p_queue_id, v_gid, p_name, p_on_lag, p_lag_timeout_s);
    INSERT INTO {schema}.ring_lanes (queue_id, lane, pos)
    SELECT v_gid, t.lane,
           CASE WHEN p_earliest THEN min(t.pos)
                ELSE greatest(max(t.pos), v_issued + 1 + ((t.lane - (v_issued + 1) % v_lanes + v_lanes) % v_lanes))
           END
    FROM {schema}.ring_lanes t
    WHERE t.queue_id = p_queue_id
       OR t.queue_id IN (SELECT g.gid FROM {schema}.ring_groups g WHERE g.queue_id = p_queue_id AND g.gid <> v_gid)
    GROUP BY t.lane;
    RETURN v_gid;
END
$$;

-- Drop a consumer group (not the default one, whose rows carry the ring's queue_id): its lanes, leases,
-- messages to deliver again, failed messages, batches and row. The floor rises to what the other groups still
-- need. Returns whether it was there.
CREATE OR REPLACE FUNCTION {schema}.ring_drop_group(p_queue_id integer, p_gid integer)
RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM {schema}.ring_groups WHERE queue_id = p_queue_id AND gid = p_gid;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    DELETE FROM {schema}.ring_lanes WHERE queue_id = p_gid;
    DELETE FROM {schema}.ring_leases WHERE queue_id = p_gid;
    DELETE FROM {schema}.ring_retry WHERE queue_id = p_gid;
    DELETE FROM {schema}.ring_failed WHERE queue_id = p_gid;
    DELETE FROM {schema}.batches WHERE queue_id = p_gid;
    PERFORM {schema}.ring_rows_drop_group(p_queue_id, p_gid);
    RETURN true;
END
$$;

-- The floor of a ring: the lowest number that some consumer may still need, below which a slot's
-- message may be overwritten. It is the lowest, over every consumer group, of the lanes' positions
-- (numbers not taken yet), of the open leases (taken at least once, not acked) and of the messages to
-- deliver again. A committed floor never goes down: a number becomes needed again only by moving from a
-- lease to the retry rows, in one transaction, a pop's take and its lease commit together, and a new
-- group's lanes start at or above the floor (ring_add_group). So a floor read by an earlier snapshot is
-- a safe bound for a later write. PostgreSQL does not inline it (a body with subqueries
-- is never inlined): each call runs its three index scans (and the probe of ring_groups) through the SQL-function executor, about
-- 90,000 instructions, a third of a push of one (written out in the push's UPDATE it costs nearly as
-- much: the executor starts the same three scans).
CREATE OR REPLACE FUNCTION {schema}.ring_floor(p_queue_id integer) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT least(
        (SELECT min(l.pos) FROM {schema}.ring_lanes l WHERE l.queue_id = p_queue_id),
        (SELECT min(e.lo) FROM {schema}.ring_leases e WHERE e.queue_id = p_queue_id),
        (SELECT min(r.id) FROM {schema}.ring_retry r WHERE r.queue_id = p_queue_id),
        (SELECT min(least(
            (SELECT min(l.pos) FROM {schema}.ring_lanes l WHERE l.queue_id = g.gid),
            (SELECT min(e.lo) FROM {schema}.ring_leases e WHERE e.queue_id = g.gid),
            (SELECT min(r.id) FROM {schema}.ring_retry r WHERE r.queue_id = g.gid)))
         FROM {schema}.ring_groups g WHERE g.queue_id = p_queue_id))
$$;

-- The gap proof. A push takes an xid before its numbers, and every transaction with an xid holds the
-- lock on its own transactionid until it ends. So the transactions listed by ring_holders() after a
-- push position was read include every live holder of a number up to that position, and once
-- ring_holders_gone() says none of them holds its lock any more, nobody can still write such a number.
-- (A snapshot's in-progress list cannot serve: it names only xids below its xmax, one past the latest
-- completed xid, so a newer transaction still running is missing from it.) The caller's own xid is
-- left out: it is not a holder it waits for. pg_locks is readable by every role.
CREATE OR REPLACE FUNCTION {schema}.ring_holders() RETURNS xid[]
LANGUAGE sql VOLATILE AS $$
    SELECT coalesce(array_agg(l.transactionid), ARRAY[]::xid[])
    FROM pg_locks l
    WHERE l.locktype = 'transactionid' AND l.granted
      AND l.transactionid IS DISTINCT FROM pg_current_xact_id_if_assigned()::xid
$$;

CREATE OR REPLACE FUNCTION {schema}.ring_holders_gone(p_holders xid[]) RETURNS boolean
LANGUAGE sql VOLATILE AS $$
    SELECT NOT EXISTS (
        SELECT 1 FROM pg_locks l
        WHERE l.locktype = 'transactionid' AND l.granted AND l.transactionid = ANY (p_holders))
$$;

-- Push a batch: take n contiguous numbers and write them into their slots, all or nothing, in the
-- caller's transaction. Returns the first number as r_first (the ids are first .. first + n - 1), or
-- NULL when the ring is full for the batch before anything was taken (the caller waits and calls
-- again), and as r_floor the ring's floor when it read it (NULL when p_floor sufficed).
-- A slot is written when it holds the number a capacity before ours and that number is below the
-- ring's floor (no consumer needs it). p_floor: a floor the caller read earlier (r_floor of an earlier
-- push, or ring_floor), or NULL. A floor never goes down, so any floor once read is a safe bound: the
-- push reads the ring's own only when the one given leaves no room for the batch, and before writing
-- again after a wait. A slot not free yet (the ring is full there, or its previous
-- number is a gap not given up yet) is waited for with backoff up to p_timeout_s, then SQLSTATE DQ001.
-- Slots already written stay locked meanwhile (nothing is visible before commit). If a consumer gave
-- one of our numbers up as a gap (only when it proved every transaction that could hold it finished,
-- or after its gap timeout), SQLSTATE DQ002: the statement fails whole and the caller retries with new
-- numbers. Such a slot holds our number without a payload, and later a number past ours once the ring
-- has gone round over it (nobody else writes our number, so a higher one there means ours was given
-- up): both are DQ002, or a push that waited too long would wait for a slot that can never hold the
-- number before ours again, and fail as full. Besides our push, only gap skips write a slot that holds
-- the number before ours; they lock with SKIP LOCKED and commit at once, so our UPDATE waits on nothing
-- else, and after such a wait it finds the number given up (DQ002). So pushes never wait on each other
-- or on consumers.
-- p_notify: 0 never, 1 when some consumer group had taken every number before ours already (its
-- consumers caught up: they may be waiting), 2 always.
-- p_cap is the ring's capacity, which the caller read with the queue (it never changes); the sequences
-- are found by name. Steps without a table are assignments, which PL/pgSQL evaluates without the
-- executor (a PERFORM or SELECT INTO is a query of its own, about 25 us each).
-- p_first: the numbers were taken already, from p_first on (ring_push_one took one and found its slot
-- not free yet): they are written, waiting as above, instead of new ones taken.
CREATE OR REPLACE FUNCTION {schema}.ring_push(
    p_queue_id integer, p_cap integer, p_payloads bytea[], p_timeout_s double precision, p_notify integer,
    p_channel text, p_first bigint, p_floor bigint, OUT r_first bigint, OUT r_floor bigint)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_bitmapscan = off AS $$
DECLARE
    v_n integer := coalesce(cardinality(p_payloads), 0);
    v_cap integer := p_cap;
    v_seq regclass := to_regclass('{schema}.ring_' || p_queue_id || '_seq');
    v_first bigint;
    v_floor bigint := p_floor;
    v_a integer;
    v_b1 integer;
    v_b2 integer;
    v_from integer;
    v_to integer;
    v_base bigint;
    v_written integer := 0;
    v_k integer;
    v_deadline timestamptz;
    v_pause double precision := 0.0005;
    v_xid xid8;
    v_ok boolean;
BEGIN
    IF v_seq IS NULL THEN
        RAISE EXCEPTION 'ring % does not exist', p_queue_id USING ERRCODE = 'DQ004';
    END IF;
    IF v_n < 1 OR v_n > v_cap THEN
        RAISE EXCEPTION 'a ring batch holds 1 to % (the capacity) messages, got %', v_cap, v_n
            USING ERRCODE = 'DQ003';
    END IF;
    -- Room first, before this transaction has an xid or any number: when the number a capacity before
    -- the highest this batch would take is not below the floor (the ring is full there), return NULL,
    -- having taken nothing; the caller waits and calls again. A transaction with an xid holds back the
    -- pruning of every row version newer than it, so a push that waited here for consumers would keep
    -- the ring's old versions from being pruned while it waited, and the heap would grow.
    -- A lane stopped at a gap (a number issued and never written) holds the floor down too: the caller
    -- helps to give it up between its calls (ring_pop of none), outside this transaction.
    -- The floor given (p_floor) is asked first: reading the ring's own costs a push of 100 about a
    -- tenth of its server instructions.
    IF p_first IS NULL AND (v_floor IS NULL
            OR coalesce(pg_sequence_last_value(v_seq), 0) + v_n - v_cap >= v_floor) THEN
        v_floor := {schema}.ring_floor(p_queue_id);
        r_floor := v_floor;
        IF v_floor IS NULL THEN  -- no lanes: the ring was dropped
            RAISE EXCEPTION 'ring % does not exist', p_queue_id USING ERRCODE = 'DQ004';
        END IF;
        IF coalesce(pg_sequence_last_value(v_seq), 0) + v_n - v_cap >= v_floor THEN
            RETURN;
        END IF;
    END IF;
    -- Give this transaction an xid before it holds any number: the gap proof relies on it.
    v_xid := pg_current_xact_id();
    -- n contiguous numbers: a batch never spans more than the capacity, so it never waits on itself,
    -- and every wait points at lower numbers (no cycle). Every push takes its numbers under this
    -- session lock, so nextval then setval to the batch's last number is a range of its own; the lock
    -- is held only for those two calls and released on error too.
    -- ring_push_one takes its number under the same lock in shared mode.
    IF p_first IS NOT NULL THEN
        v_first := p_first;
    ELSE
        v_ok := pg_advisory_lock(1685221713, (v_seq::oid::bigint - 2147483648)::integer) IS NULL;
        BEGIN
            v_first := nextval(v_seq);
            IF v_n > 1 THEN
                v_ok := setval(v_seq, v_first + v_n - 1) > 0;
            END IF;
        EXCEPTION WHEN OTHERS THEN
            v_ok := pg_advisory_unlock(1685221713, (v_seq::oid::bigint - 2147483648)::integer);
            RAISE;
        END;
        v_ok := pg_advisory_unlock(1685221713, (v_seq::oid::bigint - 2147483648)::integer);
    END IF;
    v_a := (v_first % v_cap)::integer;
    v_b1 := least(v_cap, v_a + v_n);
    v_b2 := greatest(0, v_a + v_n - v_cap);
    v_deadline := clock_timestamp() + make_interval(secs => p_timeout_s);
    LOOP
        -- A floor read before the numbers were taken still bounds the first write (a floor never goes
        -- down); each later attempt reads it again.
        IF v_floor IS NULL THEN
            v_floor := {schema}.ring_floor(p_queue_id);
            r_floor := v_floor;
            IF v_floor IS NULL THEN
                RAISE EXCEPTION 'ring % does not exist', p_queue_id USING ERRCODE = 'DQ004';
            END IF;
        END IF;
        FOR part IN 1 .. 2 LOOP
            IF part = 1 THEN
                v_from := v_a; v_to := v_b1; v_base := v_first - v_a;
            ELSE
                v_from := 0; v_to := v_b2; v_base := v_first + v_cap - v_a;
            END IF;
            CONTINUE WHEN v_to <= v_from;
            UPDATE {schema}.ring_slots s
            SET seq = v_base + s.slot, enqueued_at = now(),
                payload = p_payloads[(v_base + s.slot - v_first + 1)::integer]
            WHERE s.queue_id = p_queue_id AND s.slot >= v_from AND s.slot < v_to
              AND s.seq = v_base + s.slot - v_cap AND s.seq < v_floor;
            GET DIAGNOSTICS v_k = ROW_COUNT;
            v_written := v_written + v_k;
        END LOOP;
        EXIT WHEN v_written >= v_n;
        IF EXISTS (
            SELECT 1 FROM {schema}.ring_slots t
            WHERE t.queue_id = p_queue_id AND t.slot >= v_a AND t.slot < v_b1
              AND (t.seq = v_first - v_a + t.slot AND t.payload IS NULL OR t.seq > v_first - v_a + t.slot)
            UNION ALL
            SELECT 1 FROM {schema}.ring_slots t
            WHERE t.queue_id = p_queue_id AND t.slot < v_b2
              AND (t.seq = v_first + v_cap - v_a + t.slot AND t.payload IS NULL
                   OR t.seq > v_first + v_cap - v_a + t.slot)) THEN
            RAISE EXCEPTION 'ring %: numbers % .. % were given up as gaps before this push wrote them',
                p_queue_id, v_first, v_first + v_n - 1 USING ERRCODE = 'DQ002';
        END IF;
        IF clock_timestamp() >= v_deadline THEN
            RAISE EXCEPTION 'ring % stayed full for % s (capacity %)', p_queue_id, p_timeout_s, v_cap
                USING ERRCODE = 'DQ001';
        END IF;
        PERFORM pg_sleep(v_pause);
        v_pause := least(v_pause * 2, 0.05);
        v_floor := NULL;
    END LOOP;
    IF p_notify > 0 THEN  -- a condition with a subquery is a query of its own: only when it can notify
        IF p_notify = 2 OR NOT EXISTS (
                SELECT 1 FROM {schema}.ring_lanes l WHERE l.queue_id = p_queue_id AND l.pos < v_first)
            OR EXISTS (
                SELECT 1 FROM {schema}.ring_groups g
                WHERE g.queue_id = p_queue_id AND NOT EXISTS (
                    SELECT 1 FROM {schema}.ring_lanes l WHERE l.queue_id = g.gid AND l.pos < v_first)) THEN
            PERFORM pg_notify(p_channel, '');
        END IF;
    END IF;
    r_first := v_first;
END
$$;

-- Push one message in one statement: the path of a push of one outside a caller's transaction (the
-- usual call at batch 1). ring_push is a PL/pgSQL loop that can wait; this tries once. It takes one
-- number, under the push lock in shared mode until its transaction ends (a batch takes a range under it
-- in exclusive mode, so that no single number lands inside the range), and writes the slot if it is
-- free. Returns the number when it was written, minus the number when its slot was not free yet (the
-- ring is full there: the caller writes the number with ring_push(p_first => number), which waits for
-- the slot; in between, the number is issued and unwritten, as a push in progress is), and NULL when
-- the ring does not exist. The number is taken before this transaction has an xid (the gap proof
-- relies on a push having one first), so a pop could give it up as a gap in that instant: the UPDATE
-- then finds the slot moved on and writes nothing, and ring_push fails with DQ002 (new numbers). So
-- too between this statement and ring_push's xid, when no transaction holds the number: ring_push
-- fails with DQ002 whether the slot still holds it given up or the ring has gone round over it.
-- p_floor: a floor of this ring that the caller read earlier (ring_floor), or NULL to read it now. A
-- committed floor never goes down, so one read by any earlier transaction that wrote nothing bounds
-- this write too; reading it costs three index scans through the SQL-function executor, more than the
-- rest of the push (120,000 of 290,000 instructions), and it changes only as fast as consumers move.
-- When the slot is not free under it, the caller writes the number through ring_push, which reads the
-- floor itself, and reads a new one for its next pushes.
-- p_notify as in ring_push. PL/pgSQL with a generic plan, so that its UPDATE is planned once a
-- session, and a scalar result, which costs the server less than a set's.
CREATE OR REPLACE FUNCTION {schema}.ring_push_one(
    p_queue_id integer, p_cap integer, p_payload bytea, p_notify integer, p_channel text, p_floor bigint)
RETURNS bigint LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_seq regclass := to_regclass('{schema}.ring_' || p_queue_id || '_seq');
    v_num bigint;
    v_ok boolean;
BEGIN
    IF v_seq IS NULL THEN
        RETURN NULL;
    END IF;
    v_ok := pg_advisory_xact_lock_shared(1685221713, (v_seq::oid::bigint - 2147483648)::integer) IS NULL;
    v_num := nextval(v_seq);
    UPDATE {schema}.ring_slots s
    SET seq = v_num, enqueued_at = now(), payload = p_payload
    WHERE s.queue_id = p_queue_id AND s.slot = (v_num % p_cap)::integer
      AND s.seq = v_num - p_cap AND s.seq < coalesce(p_floor, {schema}.ring_floor(p_queue_id));
    IF NOT FOUND THEN
        RETURN -v_num;
    END IF;
    IF p_notify > 0 THEN  -- a condition with a subquery is a query of its own: only when it can notify
        IF p_notify = 2 OR NOT EXISTS (
                SELECT 1 FROM {schema}.ring_lanes l WHERE l.queue_id = p_queue_id AND l.pos < v_num)
            OR EXISTS (
                SELECT 1 FROM {schema}.ring_groups g
                WHERE g.queue_id = p_queue_id AND NOT EXISTS (
                    SELECT 1 FROM {schema}.ring_lanes l WHERE l.queue_id = g.gid AND l.pos < v_num)) THEN
            PERFORM pg_notify(p_channel, '');
        END IF;
    END IF;
    RETURN v_num;
END
$$;

-- Take up to p_n messages from the lanes: the fast path of every pop, and the last step of ring_pop.
-- Lanes are locked with SKIP LOCKED, lowest position first: a pop of one takes one lane, a batch up to
-- p_n of them, so that consumers take from different lanes at once. Within the lanes it holds, a pop
-- takes the numbers from their positions on, in id order, up to the first number that is issued but not
-- written yet (a push in progress, or a gap): positions never pass a number nobody has seen, so every
-- message is delivered. A lane whose next number is not written is left alone for this pop. The
-- window is at most a capacity of numbers from the lowest position held, no further than the issued
-- position and about p_n messages of the lanes held. Numbers given up as gaps (no payload) are passed
-- over and not returned. The positions move past the last number taken; with p_lease the messages are leased as one
-- ring_leases row, otherwise they are finished when the transaction commits.
-- Every message returned is on its first delivery (r_attempts and r_deliveries are 1). Leased, they
-- share one lease end, which only the first message returned carries in r_lease_until (NULL on the
-- others): a timestamp costs the client about 1,800 instructions a row to read, a NULL nearly nothing.
-- ring_pop, which passes these rows on, puts the lease end on each of them.
-- p_queue_id: the ring's queue_id, for its default group; for another consumer group its gid (negative,
-- ring_groups), the key of its lanes, leases and retry rows, whose ring is looked up. So the default
-- group's pops pass what a ring without groups needs, and plan alike (an argument more, or one with a
-- default, costs the planning of every call: about 6,000 and 8,000 instructions of a pop of one).
-- ring_pop takes the same; ring_held, ring_split_leases, ring_settle, ring_reclaim_expired and
-- ring_ready take the ring's queue_id and the group's key (p_gid: the queue_id for the default group).
-- p_retries: first check whether messages to deliver again are ready, and take nothing if so (ring_pop
-- serves them first). p_wait: when every lane with a message is locked by other pops, wait for the
-- lowest of them instead of returning nothing, at most lock_timeout (1 s): batch consumers then take
-- turns with the lanes, each pop one short transaction, instead of finding nothing and calling again.
-- A pop that waited and finds the lanes with a message held again fails with lock_not_available, as
-- when its wait runs out: the client pops again (in a new transaction) for up to its lane_timeout, so
-- that a pop returns nothing only when nothing is ready that another transaction is not taking.
-- Plans are generic (the ring's tables never change size, so their statistics never mislead) and never
-- bitmap scans: the scan walks the primary key in slot order.
CREATE OR REPLACE FUNCTION {schema}.ring_take(
    p_queue_id integer, p_cap integer, p_lanes integer, p_n integer, p_lease boolean, p_vt double precision,
    p_consumer text, p_retries boolean, p_wait boolean)
RETURNS TABLE (r_id bigint, r_attempts integer, r_deliveries integer, r_enqueued_at timestamptz,
               r_lease_until timestamptz, r_payload bytea)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_bitmapscan = off SET lock_timeout = 1000
AS $$
DECLARE
    v_gid integer := p_queue_id;
    v_until timestamptz := CASE WHEN p_lease THEN now() + make_interval(secs => p_vt) END;
    v_lanes integer[];
    v_pos bigint[];
    v_lo bigint;
    v_p bigint[];
    v_issued bigint;
    v_a integer;
    v_span bigint;
    v_k integer;
    v_got integer := 0;
    v_top bigint;
    v_first bigint;
    v_last bigint;
    v_whole boolean;
    v_wait integer;
BEGIN
    IF p_queue_id < 0 THEN  -- a consumer group's gid: the key of its rows; p_queue_id becomes its ring's
        SELECT g.queue_id INTO p_queue_id FROM {schema}.ring_groups g WHERE g.gid = v_gid;
    END IF;
    IF p_n = 1 AND p_wait THEN
        -- One message, in a transaction of its own: the lowest lane whose next number is written, moved
        -- on, and nothing when messages to deliver again are due (an InitPlan of the same statement).
        -- The lanes are locked in position order and only then is each one's next slot read, up to the
        -- first one written: nearly always the first, where reading every lane's slot before choosing
        -- cost a probe of the slots' index a lane (with 8 lanes, 65,000 of 405,000 instructions). A lane
        -- passed over stays locked until this short transaction ends; in a caller's transaction (no
        -- p_wait) a pop of one goes the batch's way below, which locks only the lane it takes.
        IF NOT p_lease THEN
            RETURN QUERY
            WITH l AS (
                SELECT k.lane, k.pos FROM (
                    SELECT t.lane, t.pos FROM {schema}.ring_lanes t
                    WHERE t.queue_id = v_gid AND NOT (p_retries AND EXISTS (
                        SELECT 1 FROM {schema}.ring_retry r
                        WHERE r.queue_id = v_gid AND r.state = 1 AND r.due_at <= now()))
                    ORDER BY t.pos
                    FOR UPDATE SKIP LOCKED) k
                WHERE EXISTS (
                    SELECT 1 FROM {schema}.ring_slots s
                    WHERE s.queue_id = p_queue_id AND s.slot = (k.pos % p_cap)::integer AND s.seq = k.pos)
                LIMIT 1
            ), u AS (
                UPDATE {schema}.ring_lanes t SET pos = t.pos + p_lanes
                FROM l WHERE t.queue_id = v_gid AND t.lane = l.lane
                RETURNING l.pos
            )
            SELECT s.seq, 1, 1, s.enqueued_at, NULL::timestamptz, s.payload
            FROM u JOIN {schema}.ring_slots s ON s.queue_id = p_queue_id AND s.slot = (u.pos % p_cap)::integer
            WHERE s.payload IS NOT NULL;
        ELSE
            RETURN QUERY
            WITH l AS (
                SELECT k.lane, k.pos FROM (
                    SELECT t.lane, t.pos FROM {schema}.ring_lanes t
                    WHERE t.queue_id = v_gid AND NOT (p_retries AND EXISTS (
                        SELECT 1 FROM {schema}.ring_retry r
                        WHERE r.queue_id = v_gid AND r.state = 1 AND r.due_at <= now()))
                    ORDER BY t.pos
                    FOR UPDATE SKIP LOCKED) k
                WHERE EXISTS (
                    SELECT 1 FROM {schema}.ring_slots s
                    WHERE s.queue_id = p_queue_id AND s.slot = (k.pos % p_cap)::integer AND s.seq = k.pos)
                LIMIT 1
            ), u AS (
                UPDATE {schema}.ring_lanes t SET pos = t.pos + p_lanes
                FROM l WHERE t.queue_id = v_gid AND t.lane = l.lane
                RETURNING l.lane, l.pos
            ), m AS (
                SELECT u.lane, s.seq, s.enqueued_at, s.payload
                FROM u JOIN {schema}.ring_slots s ON s.queue_id = p_queue_id AND s.slot = (u.pos % p_cap)::integer
            ), e AS (
                INSERT INTO {schema}.ring_leases (queue_id, lo, hi, starts, n, lease_until, consumer)
                SELECT v_gid, m.seq, m.seq,
                       (SELECT array_agg(CASE WHEN g = m.lane THEN m.seq END ORDER BY g)
                        FROM generate_series(0, p_lanes - 1) AS g),
                       1, v_until, p_consumer
                FROM m WHERE m.payload IS NOT NULL
            )
            SELECT m.seq, 1, 1, m.enqueued_at, v_until, m.payload FROM m WHERE m.payload IS NOT NULL;
        END IF;
        GET DIAGNOSTICS v_k = ROW_COUNT;
        IF v_k > 0 OR NOT p_wait THEN
            RETURN;
        END IF;
    END IF;
    -- A batch: the lanes whose next number is written, lowest first, as many as the batch could use;
    -- none while messages to deliver again are due.
    SELECT array_agg(l.lane), array_agg(l.pos), min(l.pos) INTO v_lanes, v_pos, v_lo
    FROM (SELECT t.lane, t.pos FROM {schema}.ring_lanes t
          WHERE t.queue_id = v_gid AND EXISTS (
              SELECT 1 FROM {schema}.ring_slots s
              WHERE s.queue_id = p_queue_id AND s.slot = (t.pos % p_cap)::integer AND s.seq = t.pos)
            AND NOT (p_retries AND EXISTS (
              SELECT 1 FROM {schema}.ring_retry r
              WHERE r.queue_id = v_gid AND r.state = 1 AND r.due_at <= now()))
          ORDER BY t.pos LIMIT least(p_n, p_lanes) FOR UPDATE SKIP LOCKED) l;
    -- Conditions with a subquery are statements of their own, which start an executor each time they
    -- are evaluated (about 17,000 instructions each, whatever the outcome): they are asked only when no
    -- lane was taken, under a plain test of v_lanes.
    IF v_lanes IS NULL THEN
        IF p_retries AND EXISTS (
                SELECT 1 FROM {schema}.ring_retry r
                WHERE r.queue_id = v_gid AND r.state = 1 AND r.due_at <= now()) THEN
            RETURN;
        END IF;
        IF NOT p_wait THEN
            RETURN;
        END IF;
        -- No lane with a message is free: those whose next number is written are held by other pops,
        -- which take a part of them at most. Wait for the lowest of them (nothing when none has a message),
        -- then take free ones up to half the lanes. A pop that finds the lanes free takes all it can use
        -- (one consumer alone sees ids in order); consumers popping at the same time then share the lanes,
        -- each its part, instead of taking turns with all of them (one pop at a time, measured at 1.27x
        -- the naive queue with one consumer and 1.34x with two at 2x2 batch 100, where the naive queue
        -- gained nothing either).
        -- A lane past the issued position has nothing written (the usual empty pop): its slot is not read.
        v_issued := coalesce(pg_sequence_last_value(to_regclass('{schema}.ring_' || p_queue_id || '_seq')), 0);
        SELECT t.lane INTO v_wait FROM {schema}.ring_lanes t
        WHERE t.queue_id = v_gid AND t.pos <= v_issued AND EXISTS (
            SELECT 1 FROM {schema}.ring_slots s
            WHERE s.queue_id = p_queue_id AND s.slot = (t.pos % p_cap)::integer AND s.seq = t.pos)
        ORDER BY t.pos LIMIT 1;
        IF v_wait IS NULL THEN
            RETURN;
        END IF;
        SELECT array_agg(l.lane), array_agg(l.pos) INTO v_lanes, v_pos
        FROM (SELECT t.lane, t.pos FROM {schema}.ring_lanes t WHERE t.queue_id = v_gid AND t.lane = v_wait
              FOR UPDATE) l;
        IF p_n > 1 AND p_lanes > 2 THEN
            SELECT v_lanes || coalesce(array_agg(l.lane), ARRAY[]::integer[]),
                   v_pos || coalesce(array_agg(l.pos), ARRAY[]::bigint[])
            INTO v_lanes, v_pos
            FROM (SELECT t.lane, t.pos FROM {schema}.ring_lanes t
                  WHERE t.queue_id = v_gid AND t.lane <> v_lanes[1]
                  ORDER BY t.pos LIMIT least(p_n, p_lanes / 2) - 1 FOR UPDATE SKIP LOCKED) l;
        END IF;
        -- Only those whose next number is written: a lane stopped at a push in progress or a gap gives
        -- nothing now, and must not stop the others.
        SELECT array_agg(u.lane), array_agg(u.pos), min(u.pos) INTO v_lanes, v_pos, v_lo
        FROM unnest(v_lanes, v_pos) AS u(lane, pos)
        JOIN {schema}.ring_slots s
          ON s.queue_id = p_queue_id AND s.slot = (u.pos % p_cap)::integer AND s.seq = u.pos;
        IF v_lanes IS NULL THEN
            -- The lane waited for was emptied by its holder: the lanes with a message now, free ones (and
            -- this pop's own) locked. When other pops hold every one of them again, the pop fails with
            -- lock_not_available, and the client pops again in a new transaction (which waits holding no
            -- lane) rather than answer that nothing is ready.
            SELECT array_agg(l.lane), array_agg(l.pos), min(l.pos) INTO v_lanes, v_pos, v_lo
            FROM (SELECT t.lane, t.pos FROM {schema}.ring_lanes t
                  WHERE t.queue_id = v_gid AND EXISTS (
                      SELECT 1 FROM {schema}.ring_slots s
                      WHERE s.queue_id = p_queue_id AND s.slot = (t.pos % p_cap)::integer AND s.seq = t.pos)
                  ORDER BY t.pos LIMIT least(p_n, p_lanes) FOR UPDATE SKIP LOCKED) l;
            IF v_lanes IS NULL AND EXISTS (
                    SELECT 1 FROM {schema}.ring_lanes t
                    WHERE t.queue_id = v_gid AND EXISTS (
                        SELECT 1 FROM {schema}.ring_slots s
                        WHERE s.queue_id = p_queue_id AND s.slot = (t.pos % p_cap)::integer
                          AND s.seq = t.pos)) THEN
                RAISE EXCEPTION 'every lane of ring % with a message is held by another transaction', p_queue_id
                    USING ERRCODE = 'lock_not_available';
            END IF;
        END IF;
    END IF;
    IF v_lanes IS NULL THEN
        RETURN;
    END IF;
    v_issued := coalesce(pg_sequence_last_value(to_regclass('{schema}.ring_' || p_queue_id || '_seq')), 0);
    v_span := least(p_cap::bigint, v_issued - v_lo + 1, p_n::bigint * p_lanes / cardinality(v_lanes) + p_lanes);
    -- The window's rows of the lanes held, past their positions, in slot order, which is id order up
    -- to the end of the slots: "bad" counts the unwritten numbers so far and "before" the messages, so
    -- the rows before the first unwritten number, up to the p_n-th message, are taken. One lease row
    -- holds what was taken: every number of a held lane from its position up to the last one taken.
    -- A window that runs past the end of the slots is taken in two parts (two statements, two lease
    -- rows), the second from slot 0 once the first took everything to the end: one statement over both
    -- would sort its rows, as the number is not the slot's order there.
    FOR part IN 1 .. 2 LOOP
        EXIT WHEN v_span <= 0 OR v_got >= p_n;
        v_p := array_fill(NULL::bigint, ARRAY[p_lanes]);
        FOR i IN 1 .. cardinality(v_lanes) LOOP
            v_p[v_lanes[i] + 1] := v_pos[i];
        END LOOP;
        v_a := (v_lo % p_cap)::integer;
        -- Where the take ends, from the slots' numbers alone (no payload is copied). Usually every number
        -- of the first p_n - v_got rows is written: the take ends at the last of them. Otherwise it ends
        -- before the first one unwritten, up to the (p_n - v_got)-th message ("bad" counts the unwritten
        -- numbers so far and "before" the messages).
        SELECT max(r.x), min(r.x) FILTER (WHERE r.msg), max(r.x) FILTER (WHERE r.msg),
               count(*) FILTER (WHERE r.msg)::integer, bool_and(r.seq = r.x)
        INTO v_top, v_first, v_last, v_k, v_whole
        FROM (
            SELECT v_lo - v_a + s.slot AS x, s.seq, s.payload IS NOT NULL AS msg
            FROM {schema}.ring_slots s
            WHERE s.queue_id = p_queue_id AND s.slot >= v_a AND s.slot < least(p_cap, v_a + v_span)
              AND v_lo - v_a + s.slot >= v_p[((v_lo - v_a + s.slot) % p_lanes)::integer + 1]
            ORDER BY s.slot
            LIMIT p_n - v_got) r;
        IF NOT v_whole THEN
            SELECT max(w.x), min(w.x) FILTER (WHERE w.msg), max(w.x) FILTER (WHERE w.msg),
                   count(*) FILTER (WHERE w.msg)::integer
            INTO v_top, v_first, v_last, v_k
            FROM (
                SELECT r.x, r.msg,
                       count(*) FILTER (WHERE r.seq <> r.x) OVER o AS bad,
                       count(*) FILTER (WHERE r.msg) OVER o - r.msg::integer AS before
                FROM (
                    SELECT s.slot, v_lo - v_a + s.slot AS x, s.seq, s.payload IS NOT NULL AS msg
                    FROM {schema}.ring_slots s
                    WHERE s.queue_id = p_queue_id AND s.slot >= v_a AND s.slot < least(p_cap, v_a + v_span)
                      AND v_lo - v_a + s.slot >= v_p[((v_lo - v_a + s.slot) % p_lanes)::integer + 1]
                    ORDER BY s.slot) r
                WINDOW o AS (ORDER BY r.slot ROWS UNBOUNDED PRECEDING)) w
            WHERE w.bad = 0 AND w.before < p_n - v_got;
        END IF;
        EXIT WHEN v_top IS NULL;
        -- One statement moves the lanes past the last number taken, writes the lease row (at least
        -- once) and reads the messages. At most once it has no INSERT: a data-modifying CTE is opened
        -- (the leases' table and its indexes) and run on every call, even when it writes nothing.
        IF NOT p_lease THEN
            RETURN QUERY
            WITH u AS (
                UPDATE {schema}.ring_lanes l
                SET pos = greatest(l.pos, v_top + 1 + ((l.lane - (v_top + 1) % p_lanes + p_lanes) % p_lanes))
                WHERE l.queue_id = v_gid AND l.lane = ANY (v_lanes)
            )
            SELECT v_lo - v_a + s.slot, 1, 1, s.enqueued_at, NULL::timestamptz, s.payload
            FROM {schema}.ring_slots s
            WHERE s.queue_id = p_queue_id AND s.slot >= v_a AND s.slot <= v_top - v_lo + v_a
              AND v_lo - v_a + s.slot >= v_p[((v_lo - v_a + s.slot) % p_lanes)::integer + 1]
              AND s.payload IS NOT NULL;
        ELSE
            RETURN QUERY
            WITH u AS (
                UPDATE {schema}.ring_lanes l
                SET pos = greatest(l.pos, v_top + 1 + ((l.lane - (v_top + 1) % p_lanes + p_lanes) % p_lanes))
                WHERE l.queue_id = v_gid AND l.lane = ANY (v_lanes)
            ), e AS (
                INSERT INTO {schema}.ring_leases (queue_id, lo, hi, starts, n, lease_until, consumer)
                SELECT v_gid, v_first, v_last, v_p, v_k, v_until, p_consumer WHERE v_k > 0
            )
            SELECT v_lo - v_a + s.slot, 1, 1, s.enqueued_at,
                   CASE WHEN v_got = 0 AND v_lo - v_a + s.slot = v_first THEN v_until END, s.payload
            FROM {schema}.ring_slots s
            WHERE s.queue_id = p_queue_id AND s.slot >= v_a AND s.slot <= v_top - v_lo + v_a
              AND v_lo - v_a + s.slot >= v_p[((v_lo - v_a + s.slot) % p_lanes)::integer + 1]
              AND s.payload IS NOT NULL;
        END IF;
        GET DIAGNOSTICS v_k = ROW_COUNT;
        v_got := v_got + v_k;
        EXIT WHEN v_a + v_span <= p_cap OR v_got >= p_n;
        -- Past the end of the slots: go on from slot 0 only if the held lanes took everything up to it.
        SELECT array_agg(t.lane), array_agg(t.pos), min(t.pos) INTO v_lanes, v_pos, v_top
        FROM {schema}.ring_lanes t WHERE t.queue_id = v_gid AND t.lane = ANY (v_lanes);
        EXIT WHEN v_top < v_lo - v_a + p_cap;
        v_span := v_span - (p_cap - v_a);
        v_lo := v_lo - v_a + p_cap;
    END LOOP;
END
$$;

-- Move lanes on over numbers given up as gaps at their heads (a slot holding the number with no
-- payload). Nothing is delivered by that, so whoever can lock a lane may do it: pops pass such numbers
-- as they take, and pushes waiting for the floor and maintenance pass them too, so that a ring whose
-- consumers are away does not stay full of given-up numbers. Lanes held by pops are left to them. The
-- lanes of every consumer group move. Returns how many lanes moved.
CREATE OR REPLACE FUNCTION {schema}.ring_pass(p_queue_id integer, p_cap integer, p_lanes integer)
RETURNS integer LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
DECLARE
    v_moved integer := 0;
    v_pos bigint;
    r record;
BEGIN
    FOR r IN SELECT t.queue_id, t.lane, t.pos FROM {schema}.ring_lanes t
             WHERE t.queue_id = p_queue_id
                OR t.queue_id IN (SELECT g.gid FROM {schema}.ring_groups g WHERE g.queue_id = p_queue_id)
             ORDER BY t.queue_id, t.lane FOR UPDATE SKIP LOCKED LOOP
        v_pos := r.pos;
        WHILE EXISTS (
                SELECT 1 FROM {schema}.ring_slots s
                WHERE s.queue_id = p_queue_id AND s.slot = (v_pos % p_cap)::integer AND s.seq = v_pos
                  AND s.payload IS NULL) LOOP
            v_pos := v_pos + p_lanes;
        END LOOP;
        IF v_pos > r.pos THEN
            UPDATE {schema}.ring_lanes SET pos = v_pos
            WHERE queue_id = r.queue_id AND lane = r.lane;
            v_moved := v_moved + 1;
        END IF;
    END LOOP;
    RETURN v_moved;
END
$$;

-- Give up abandoned numbers (gaps) of a ring, as pops and maintenance do: the numbers from p_gap up to
-- p_issued (at most 4096) still unwritten, whose slot holds the number a capacity before them below the
-- floor and that nobody holds locked, once every holder in p_holders is gone (listed by ring_holders()
-- after p_issued was read). Without that proof, p_force (a gap timeout ran out: some transaction listed
-- is still running) gives up the run of unwritten numbers that starts at p_gap, up to the first written
-- or locked one. Those numbers' slots are free for them, so a live push would have written them the
-- moment it took them: they belong to pushes that rolled back or died, or to one stalled that long
-- between taking its numbers and writing them, which then fails with DQ002 and pushes again. Numbers
-- past the run (a live holder beyond a written number) are kept. Nothing happens unless p_gap is still
-- unwritten. A given-up number's slot holds it with no payload. Returns how many numbers it gave up.
CREATE OR REPLACE FUNCTION {schema}.ring_skip_gap(
    p_queue_id integer, p_cap integer, p_gap bigint, p_issued bigint, p_holders xid[], p_force boolean)
RETURNS integer LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_bitmapscan = off AS $$
DECLARE
    v_a integer := (p_gap % p_cap)::integer;
    v_max integer := least(greatest(coalesce(p_issued, p_gap), p_gap) - p_gap + 1, 4096, p_cap)::integer;
    v_floor bigint := {schema}.ring_floor(p_queue_id);
    v_span integer := 0;
    v_from integer;
    v_to integer;
    v_base bigint;
    v_k integer;
    v_skipped integer := 0;
BEGIN
    IF EXISTS (
            SELECT 1 FROM {schema}.ring_slots t
            WHERE t.queue_id = p_queue_id AND t.slot = v_a AND t.seq = p_gap - p_cap AND t.seq < v_floor) THEN
        IF p_holders IS NOT NULL AND p_issued IS NOT NULL AND {schema}.ring_holders_gone(p_holders) THEN
            v_span := v_max;
        ELSIF p_force THEN
            -- The run: the numbers from p_gap on that are unwritten and that nobody holds locked, up to
            -- the first that is written or locked (a push writing it, perhaps in a long transaction of
            -- its caller: the pushes behind it may be waiting, and their numbers are kept).
            SELECT count(*) INTO v_span FROM (
                SELECT u.num, row_number() OVER (ORDER BY u.num) AS rn FROM (
                    SELECT p_gap - v_a + a.slot AS num FROM (
                        SELECT t.slot FROM {schema}.ring_slots t
                        WHERE t.queue_id = p_queue_id AND t.slot >= v_a AND t.slot < least(p_cap, v_a + v_max)
                          AND t.seq = p_gap - v_a + t.slot - p_cap AND t.seq < v_floor
                        FOR UPDATE SKIP LOCKED) AS a
                    UNION ALL
                    SELECT p_gap + p_cap - v_a + b.slot FROM (
                        SELECT t.slot FROM {schema}.ring_slots t
                        WHERE t.queue_id = p_queue_id AND t.slot < v_a + v_max - p_cap
                          AND t.seq = p_gap + p_cap - v_a + t.slot - p_cap AND t.seq < v_floor
                        FOR UPDATE SKIP LOCKED) AS b) AS u) AS w
            WHERE w.num = p_gap + w.rn - 1;
        END IF;
    END IF;
    IF v_span <= 0 THEN
        RETURN 0;
    END IF;
    FOR part IN 1 .. 2 LOOP
        IF part = 1 THEN
            v_from := v_a; v_to := least(p_cap, v_a + v_span); v_base := p_gap - v_a;
        ELSE
            v_from := 0; v_to := greatest(0, v_a + v_span - p_cap); v_base := p_gap + p_cap - v_a;
        END IF;
        CONTINUE WHEN v_to <= v_from;
        UPDATE {schema}.ring_slots s
        SET seq = v_base + s.slot, payload = NULL, enqueued_at = NULL
        WHERE s.ctid = ANY (ARRAY(
            SELECT t.ctid FROM {schema}.ring_slots t
            WHERE t.queue_id = p_queue_id AND t.slot >= v_from AND t.slot < v_to
              AND t.seq = v_base + t.slot - p_cap AND t.seq < v_floor
            FOR UPDATE SKIP LOCKED));
        GET DIAGNOSTICS v_k = ROW_COUNT;
        IF v_k > 0 THEN
            PERFORM nextval(r.gap_seq) FROM {schema}.rings r, generate_series(1, v_k)
            WHERE r.queue_id = p_queue_id;
            v_skipped := v_skipped + v_k;
        END IF;
    END LOOP;
    RETURN v_skipped;
END
$$;

-- Maintenance's gap recovery: give up every number of a ring up to p_issued that a push took and never
-- wrote, wherever it lies, once every holder in p_holders is gone. p_holders must be listed
-- (ring_holders) after p_issued was read: each such number was taken by a transaction that had an xid
-- before it (ring_push takes one first), so its holder was finished then or is listed, and is gone now.
-- A number x is unwritten while its slot holds x - capacity; it is given up when that number is below
-- the floor (its slot is free for x). Slots locked by a push writing them are passed over. Returns how
-- many numbers were given up, or -1 while some holder is still running (the caller waits and asks again).
CREATE OR REPLACE FUNCTION {schema}.ring_skip_abandoned(p_queue_id integer, p_issued bigint, p_holders xid[])
RETURNS integer LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
DECLARE
    v_cap integer;
    v_gaps regclass;
    v_k integer;
BEGIN
    IF NOT {schema}.ring_holders_gone(p_holders) THEN
        RETURN -1;
    END IF;
    SELECT capacity, gap_seq INTO v_cap, v_gaps FROM {schema}.rings WHERE queue_id = p_queue_id;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    UPDATE {schema}.ring_slots s
    SET seq = s.seq + v_cap, payload = NULL, enqueued_at = NULL
    WHERE s.ctid = ANY (ARRAY(
        SELECT t.ctid FROM {schema}.ring_slots t
        WHERE t.queue_id = p_queue_id AND t.seq + v_cap <= p_issued
          AND t.seq < {schema}.ring_floor(p_queue_id)
        FOR UPDATE SKIP LOCKED));
    GET DIAGNOSTICS v_k = ROW_COUNT;
    IF v_k > 0 THEN
        PERFORM nextval(v_gaps) FROM generate_series(1, v_k);
    END IF;
    RETURN v_k;
END
$$;

-- Pop: the path of a pop that the fast one (ring_take alone) did not fill. In order: (1) give up the gap
-- the caller saw at the head of its last pop (ring_skip_gap: with the holders' proof, or p_force after
-- the caller's gap timeout) and move every lane it can lock over given-up numbers (ring_pass); (2)
-- serve the messages to deliver again that are due, lowest id first (a lease makes each a retry row
-- leased until now + p_vt, with one more attempt; otherwise it is finished); (3) take the rest from the
-- lanes (ring_take), waiting for a lane when other pops hold every one, unless the pop runs in the
-- caller's transaction. A pop of none (p_n 0) does only (1) and the report below: a push that finds the
-- ring full calls it between its attempts, so that gaps alone never keep a ring full. Rows: the messages, then one last row (r_id
-- NULL) that reports the lowest lane position when its number is issued but not written (a push in
-- progress, or a gap), with the issued position and, from its second sighting on, the holders
-- (ring_holders) listed after that position was read: the caller passes them back (p_gap...) on its
-- next pop, which gives the gap up once those holders are gone. A head unwritten for one pop only is
-- nearly always a push writing it, so pg_locks is read only when it stays; once listed, the same
-- holders and position are passed on until the proof holds (a new list would name new transactions for
-- ever under load).
-- p_own: the pop runs in the caller's transaction, which may roll back: it skips no gap, waits for no
-- lane and reports none.
-- lock_timeout bounds the wait for lanes held by other pops (a caller's long transaction may hold them):
-- the pop then fails with a lock timeout (or lock_not_available, from ring_take), and the client pops
-- again for up to its lane_timeout.
CREATE OR REPLACE FUNCTION {schema}.ring_pop(
    p_queue_id integer, p_cap integer, p_lanes integer, p_n integer, p_lease boolean,
    p_vt double precision, p_consumer text, p_own boolean,
    p_gap bigint, p_gap_issued bigint, p_gap_snap xid[], p_force boolean)
RETURNS TABLE (r_id bigint, r_attempts integer, r_deliveries integer, r_enqueued_at timestamptz,
               r_lease_until timestamptz, r_payload bytea, r_gap bigint, r_issued bigint, r_snap xid[])
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_bitmapscan = off SET lock_timeout = 1000
AS $$
DECLARE
    v_gid integer := p_queue_id;
    v_until timestamptz := now() + make_interval(secs => p_vt);
    v_got integer := 0;
    v_issued bigint;
    v_head bigint;
BEGIN
    IF p_queue_id < 0 THEN  -- a consumer group's gid: the key of its rows; p_queue_id becomes its ring's
        SELECT g.queue_id INTO p_queue_id FROM {schema}.ring_groups g WHERE g.gid = v_gid;
    END IF;
    IF p_gap IS NOT NULL AND NOT p_own
            AND {schema}.ring_skip_gap(p_queue_id, p_cap, p_gap, p_gap_issued, p_gap_snap, p_force) > 0 THEN
        -- The lanes stopped at the numbers given up move over them now, even those this pop does not
        -- take from: until they do, those numbers keep the ring's floor down.
        PERFORM {schema}.ring_pass(p_queue_id, p_cap, p_lanes);
    END IF;
    -- The issued position, read before any list of holders below.
    v_issued := coalesce(pg_sequence_last_value(to_regclass('{schema}.ring_' || p_queue_id || '_seq')), 0);

    IF p_lease THEN
        RETURN QUERY
        WITH r AS (
            SELECT t.id FROM {schema}.ring_retry t
            WHERE t.queue_id = v_gid AND t.state = 1 AND t.due_at <= now()
            ORDER BY t.id LIMIT p_n
            FOR UPDATE SKIP LOCKED
        ), u AS (
            UPDATE {schema}.ring_retry t
            SET state = 2, attempts = t.attempts + 1, deliveries = t.deliveries + 1, due_at = v_until,
                consumer = p_consumer
            FROM r WHERE t.queue_id = v_gid AND t.id = r.id
            RETURNING t.id, t.attempts, t.deliveries
        )
        SELECT u.id, u.attempts, u.deliveries, s.enqueued_at, v_until, s.payload, NULL::bigint, NULL::bigint,
               NULL::xid[]
        FROM u JOIN {schema}.ring_slots s ON s.queue_id = p_queue_id AND s.slot = (u.id % p_cap)::integer;
    ELSE
        RETURN QUERY
        WITH r AS (
            SELECT t.id FROM {schema}.ring_retry t
            WHERE t.queue_id = v_gid AND t.state = 1 AND t.due_at <= now()
            ORDER BY t.id LIMIT p_n
            FOR UPDATE SKIP LOCKED
        ), d AS (
            DELETE FROM {schema}.ring_retry t USING r WHERE t.queue_id = v_gid AND t.id = r.id
            RETURNING t.id, t.attempts + 1 AS attempts, t.deliveries + 1 AS deliveries
        )
        SELECT d.id, d.attempts, d.deliveries, s.enqueued_at, NULL::timestamptz, s.payload, NULL::bigint,
               NULL::bigint, NULL::xid[]
        FROM d JOIN {schema}.ring_slots s ON s.queue_id = p_queue_id AND s.slot = (d.id % p_cap)::integer;
    END IF;
    GET DIAGNOSTICS v_got = ROW_COUNT;

    IF v_got < p_n THEN
        RETURN QUERY
        SELECT k.r_id, k.r_attempts, k.r_deliveries, k.r_enqueued_at, CASE WHEN p_lease THEN v_until END,
               k.r_payload, NULL::bigint, NULL::bigint, NULL::xid[]
        FROM {schema}.ring_take(v_gid, p_cap, p_lanes, p_n - v_got, p_lease, p_vt, p_consumer,
                                false, NOT p_own) AS k;
    END IF;

    IF p_own THEN
        RETURN QUERY SELECT NULL::bigint, NULL::integer, NULL::integer, NULL::timestamptz,
            NULL::timestamptz, NULL::bytea, NULL::bigint, NULL::bigint, NULL::xid[];
        RETURN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM {schema}.rings r WHERE r.queue_id = p_queue_id) THEN
        RAISE EXCEPTION 'ring % does not exist', p_queue_id USING ERRCODE = 'DQ004';
    END IF;
    -- The head: the lowest lane position whose number is issued and not written.
    SELECT l.pos INTO v_head
    FROM {schema}.ring_lanes l
    JOIN {schema}.ring_slots s ON s.queue_id = p_queue_id AND s.slot = (l.pos % p_cap)::integer
    WHERE l.queue_id = v_gid AND l.pos <= v_issued AND s.seq < l.pos
    ORDER BY l.pos LIMIT 1;
    RETURN QUERY SELECT NULL::bigint, NULL::integer, NULL::integer, NULL::timestamptz, NULL::timestamptz,
        NULL::bytea, v_head,
        CASE WHEN v_head = p_gap AND p_gap_snap IS NOT NULL THEN p_gap_issued ELSE v_issued END,
        CASE WHEN v_head IS NULL OR v_head IS DISTINCT FROM p_gap THEN NULL
             WHEN p_gap_snap IS NOT NULL THEN p_gap_snap
             ELSE {schema}.ring_holders() END;
END
$$;

-- The receipts (id, delivery) of a ring that still hold their lease: a first delivery (delivery 1)
-- inside an open lease of its range and lanes, or a retry row leased as that delivery. r_lease names the
-- lease row (its lo), NULL for a retry row. A message is in one lease or one retry row, never both.
CREATE OR REPLACE FUNCTION {schema}.ring_held(p_queue_id integer, p_lanes integer, p_ids bigint[], p_deliveries integer[],
    p_gid integer)
RETURNS TABLE (r_id bigint, r_delivery integer, r_lease bigint, r_until timestamptz)
LANGUAGE sql STABLE AS $$
    SELECT u.id, u.d, e.lo, e.lease_until
    FROM unnest(p_ids, p_deliveries) AS u(id, d)
    CROSS JOIN LATERAL (
        SELECT e.lo, e.lease_until FROM {schema}.ring_leases e
        WHERE e.queue_id = p_gid AND e.lo <= u.id AND e.hi >= u.id
          AND e.starts[(u.id % p_lanes)::integer + 1] <= u.id AND e.lease_until > now()
        ORDER BY e.lo DESC
        LIMIT 1) e
    WHERE u.d = 1
    UNION ALL
    SELECT u.id, u.d, NULL::bigint, r.due_at
    FROM unnest(p_ids, p_deliveries) AS u(id, d)
    JOIN {schema}.ring_retry r ON r.queue_id = p_gid AND r.id = u.id
    WHERE r.state = 2 AND r.deliveries = u.d AND r.due_at > now()
$$;

-- Turn whole leases into retry rows leased as before (one a message): before some of their messages
-- are acked, nacked or reclaimed alone. The caller holds the leases locked. Returns the rows made.
CREATE OR REPLACE FUNCTION {schema}.ring_split_leases(
    p_queue_id integer, p_cap integer, p_lanes integer, p_los bigint[], p_error text, p_gid integer)
RETURNS integer LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
DECLARE
    v_k integer;
BEGIN
    WITH e AS (
        DELETE FROM {schema}.ring_leases e WHERE e.queue_id = p_gid AND e.lo = ANY (p_los)
        RETURNING e.lo, e.hi, e.starts, e.lease_until, e.consumer
    )
    INSERT INTO {schema}.ring_retry (queue_id, id, state, attempts, deliveries, due_at, consumer, last_error)
    SELECT p_gid, x, 2, 1, 1, e.lease_until, e.consumer, p_error
    FROM e
    CROSS JOIN LATERAL generate_series(e.lo, e.hi) AS x
    JOIN {schema}.ring_slots s ON s.queue_id = p_queue_id AND s.slot = (x % p_cap)::integer AND s.seq = x
    WHERE e.starts[(x % p_lanes)::integer + 1] <= x AND s.payload IS NOT NULL;
    GET DIAGNOSTICS v_k = ROW_COUNT;
    RETURN v_k;
END
$$;

-- The ack of whole leases, the usual one (queries/ring.sql's ring_ack): receipts naming every message
-- of one ring_leases row or more (first deliveries; a pop writes one row, or two when it ran past the
-- end of the ring's slots). A candidate lease lies within the receipts' range and is whole when as many
-- receipts fall in its range and lanes as it holds messages; the leases are deleted only when the whole
-- ones hold every receipt (each message is in one lease at most). Returns the n of each lease deleted,
-- nothing otherwise (the caller then settles the receipts with ring_settle). A function so that its
-- plan is made once a session, generic, on the leases' key, whatever the table's size when it is made.
CREATE OR REPLACE FUNCTION {schema}.ring_ack(p_group integer, p_lanes integer, p_ids bigint[], p_deliveries integer[])
RETURNS TABLE (r_n integer)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET enable_bitmapscan = off
AS $$
BEGIN
    RETURN QUERY
    WITH r AS (
        SELECT min(u.id) AS lo, max(u.id) AS hi, count(*) AS k, bool_and(u.d = 1) AS first
        FROM unnest(p_ids, p_deliveries) AS u(id, d)
    ), c AS (
        SELECT e.ctid AS tid, e.n
        FROM {schema}.ring_leases e, r
        WHERE e.queue_id = p_group AND e.lo >= r.lo AND e.lo <= r.hi AND e.hi <= r.hi AND r.first
          AND e.lease_until > now()
          AND (SELECT count(*) FROM unnest(p_ids) AS i(id)
               WHERE i.id BETWEEN e.lo AND e.hi AND e.starts[mod(i.id, p_lanes)::integer + 1] <= i.id) = e.n
        FOR UPDATE OF e
    )
    DELETE FROM {schema}.ring_leases e
    WHERE e.ctid = ANY (ARRAY(SELECT c.tid FROM c)) AND (SELECT sum(c.n) FROM c) = (SELECT r.k FROM r)
    RETURNING e.n;
END
$$;

-- Ack (p_nack false) or nack the deliveries named by receipts, all or nothing: when any receipt does
-- not hold its lease, nothing changes and no row comes back (the caller asks ring_held which did).
-- Leases are split into retry rows first (ring_split_leases), so every receipt is then a retry row
-- leased as its delivery. An ack deletes them; a nack makes them ready again after p_delay_s or the
-- backoff, or, after p_max_attempts, copies them with their payload to ring_failed (their slots are
-- then free for a push). Rows: (id, state) of each: 0 finished, 1 ready again, 2 failed.
-- The leases and retry rows are locked in key order first, so two settles never deadlock.
CREATE OR REPLACE FUNCTION {schema}.ring_settle(
    p_queue_id integer, p_cap integer, p_lanes integer, p_ids bigint[], p_deliveries integer[], p_nack boolean,
    p_delay_s double precision, p_backoff_s double precision, p_backoff_max_s double precision,
    p_max_attempts integer, p_error text, p_gid integer)
RETURNS TABLE (r_id bigint, r_state integer) LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
DECLARE
    v_los bigint[];
    v_held integer;
BEGIN
    PERFORM 1 FROM {schema}.ring_leases e
    WHERE e.queue_id = p_gid AND e.lo IN (
        SELECT h.r_lease FROM {schema}.ring_held(p_queue_id, p_lanes, p_ids, p_deliveries, p_gid) h)
    ORDER BY e.lo FOR UPDATE;
    PERFORM 1 FROM {schema}.ring_retry r
    WHERE r.queue_id = p_gid AND r.id = ANY (p_ids) ORDER BY r.id FOR UPDATE;
    SELECT array_agg(DISTINCT h.r_lease) FILTER (WHERE h.r_lease IS NOT NULL), count(*)
    INTO v_los, v_held
    FROM {schema}.ring_held(p_queue_id, p_lanes, p_ids, p_deliveries, p_gid) h;
    IF v_held < cardinality(p_ids) THEN
        RETURN;
    END IF;
    IF v_los IS NOT NULL THEN
        PERFORM {schema}.ring_split_leases(p_queue_id, p_cap, p_lanes, v_los, NULL, p_gid);
    END IF;
    IF NOT p_nack THEN
        RETURN QUERY
        DELETE FROM {schema}.ring_retry r WHERE r.queue_id = p_gid AND r.id = ANY (p_ids)
        RETURNING r.id, 0;
        RETURN;
    END IF;
    RETURN QUERY
    WITH f AS (
        DELETE FROM {schema}.ring_retry r
        WHERE r.queue_id = p_gid AND r.id = ANY (p_ids) AND r.attempts >= p_max_attempts
        RETURNING r.id, r.attempts
    ), i AS (
        INSERT INTO {schema}.ring_failed (queue_id, id, attempts, enqueued_at, last_error, payload)
        SELECT p_gid, f.id, f.attempts, s.enqueued_at, p_error, s.payload
        FROM f JOIN {schema}.ring_slots s ON s.queue_id = p_queue_id AND s.slot = (f.id % p_cap)::integer
        RETURNING id
    ), u AS (
        UPDATE {schema}.ring_retry r
        SET state = 1, consumer = NULL, last_error = p_error,
            due_at = now() + make_interval(secs => coalesce(p_delay_s, least(
                p_backoff_max_s, p_backoff_s * power(2, greatest(r.attempts - 1, 0)))))
        WHERE r.queue_id = p_gid AND r.id = ANY (p_ids) AND r.attempts < p_max_attempts
        RETURNING r.id
    )
    SELECT i.id, 2 FROM i
    UNION ALL
    SELECT u.id, 1 FROM u;
END
$$;

-- Expired leases go back to ready as retry rows (keeping their ids) or, after max_attempts, to
-- ring_failed: whole ring_leases rows and leased retry rows alike, up to p_limit of each. Rows: (id,
-- state) of each message moved, 1 ready again, 2 failed.
CREATE OR REPLACE FUNCTION {schema}.ring_reclaim_expired(
    p_queue_id integer, p_cap integer, p_lanes integer, p_max_attempts integer, p_limit integer, p_gid integer)
RETURNS TABLE (r_id bigint, r_state integer) LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
DECLARE
    v_los bigint[];
BEGIN
    SELECT array_agg(e.lo) INTO v_los FROM (
        SELECT e.lo FROM {schema}.ring_leases e
        WHERE e.queue_id = p_gid AND e.lease_until <= now()
        ORDER BY e.lo LIMIT p_limit FOR UPDATE SKIP LOCKED) e;
    IF v_los IS NOT NULL THEN
        PERFORM {schema}.ring_split_leases(p_queue_id, p_cap, p_lanes, v_los, NULL, p_gid);
    END IF;
    RETURN QUERY
    WITH x AS (
        SELECT r.id, r.attempts, r.consumer FROM {schema}.ring_retry r
        WHERE r.queue_id = p_gid AND r.state = 2 AND r.due_at <= now()
        ORDER BY r.id LIMIT p_limit FOR UPDATE SKIP LOCKED
    ), f AS (
        DELETE FROM {schema}.ring_retry r USING x
        WHERE r.queue_id = p_gid AND r.id = x.id AND x.attempts >= p_max_attempts
        RETURNING r.id, r.attempts, x.consumer
    ), i AS (
        INSERT INTO {schema}.ring_failed (queue_id, id, attempts, enqueued_at, last_error, payload)
        SELECT p_gid, f.id, f.attempts, s.enqueued_at,
               'lease expired (held by ' || coalesce(f.consumer, '?') || ')', s.payload
        FROM f JOIN {schema}.ring_slots s ON s.queue_id = p_queue_id AND s.slot = (f.id % p_cap)::integer
        RETURNING id
    ), u AS (
        UPDATE {schema}.ring_retry r
        SET state = 1, due_at = now(), consumer = NULL,
            last_error = 'lease expired (held by ' || coalesce(x.consumer, '?') || ')'
        FROM x WHERE r.queue_id = p_gid AND r.id = x.id AND x.attempts < p_max_attempts
        RETURNING r.id
    )
    SELECT i.id, 2 FROM i
    UNION ALL
    SELECT u.id, 1 FROM u;
END
$$;

-- The messages of a ring that a pop could take now or later, without taking them: those of the lanes
-- past their positions (attempts 0), and those to deliver again (r_due: when they are due). For
-- observers (counts, stats, and the peek of a client older than ring_look, whose query reads this; a
-- peek reads ring_look), not for pops. A lane's message is a number x of the lane with
-- pos <= x <= the push position, so it lies in the window of numbers from the group's lowest lane
-- position (lo) to the push position (hi), whose slots are one range of the slots' key, or two where the
-- window passes the end of the slots: only those slots are read (what the group has still to take, not
-- the whole ring), in slot order, so that a count up to a cap stops after that many.
CREATE OR REPLACE FUNCTION {schema}.ring_ready(p_queue_id integer, p_gid integer)
RETURNS TABLE (r_id bigint, r_attempts integer, r_deliveries integer, r_enqueued_at timestamptz,
               r_due timestamptz, r_payload bytea)
LANGUAGE sql STABLE AS $$
    WITH w AS (
        SELECT g.queue_id, g.capacity, g.lanes, p.lo, p.pos,
               coalesce(pg_sequence_last_value(g.push_seq), 0) AS hi,
               (p.lo % g.capacity)::integer AS a
        FROM {schema}.rings g
        CROSS JOIN (SELECT min(l.pos) AS lo, array_agg(l.pos ORDER BY l.lane) AS pos
                    FROM {schema}.ring_lanes l WHERE l.queue_id = p_gid) p
        WHERE g.queue_id = p_queue_id AND p.lo IS NOT NULL
    ), n AS (
        SELECT w.*, least(w.capacity::bigint, w.hi - w.lo + 1) AS span FROM w WHERE w.hi >= w.lo
    )
    SELECT s.seq, 0, 0, s.enqueued_at, s.enqueued_at, s.payload
    FROM n JOIN {schema}.ring_slots s
      ON s.queue_id = n.queue_id AND s.slot >= n.a AND s.slot < least(n.capacity::bigint, n.a + n.span)
    WHERE s.payload IS NOT NULL AND s.seq >= n.pos[(s.seq % n.lanes)::integer + 1] AND s.seq <= n.hi
    UNION ALL
    SELECT s.seq, 0, 0, s.enqueued_at, s.enqueued_at, s.payload
    FROM n JOIN {schema}.ring_slots s
      ON s.queue_id = n.queue_id AND s.slot >= 0 AND s.slot < n.a + n.span - n.capacity
    WHERE s.payload IS NOT NULL AND s.seq >= n.pos[(s.seq % n.lanes)::integer + 1] AND s.seq <= n.hi
    UNION ALL
    SELECT r.id, r.attempts, r.deliveries, s.enqueued_at, r.due_at, s.payload
    FROM {schema}.rings g
    JOIN {schema}.ring_retry r ON r.queue_id = p_gid
    JOIN {schema}.ring_slots s ON s.queue_id = g.queue_id AND s.slot = (r.id % g.capacity)::integer
    WHERE g.queue_id = p_queue_id AND r.state = 1
$$;

-- What a peek shows: up to p_n messages of ring_ready's that are due, in the order pops take them (those
-- to deliver again first, then the lanes', each by id), read as far as they go and no further. The
-- messages to deliver again: the due retry rows, the first p_n by id. The lanes': the window's slots in
-- slot order from the lowest lane position's slot (a), which is id order (every number a slot holds lies
-- below lo + capacity, as a push may overwrite x - capacity only below the floor), on the slots' primary
-- key: from a to the end, then from 0, each range an index scan that stops at the p_n-th message it
-- keeps (a slot past its lane's position and written), so that a peek reads about the slots of what it
-- shows, and the taken ones between the lowest lane's position and the others'. PL/pgSQL with a
-- generic plan, made once a session, never a bitmap scan (whose heap reads are in block order, not
-- the index's, and unbounded).
CREATE OR REPLACE FUNCTION {schema}.ring_look(p_queue_id integer, p_gid integer, p_n integer)
RETURNS TABLE (r_id bigint, r_attempts integer, r_deliveries integer, r_enqueued_at timestamptz,
               r_payload bytea)
LANGUAGE plpgsql STABLE SET plan_cache_mode = force_generic_plan SET enable_bitmapscan = off AS $$
DECLARE
    v_cap integer;
    v_lanes integer;
    v_pos bigint[];
    v_lo bigint;
    v_hi bigint;
    v_a integer;
    v_span bigint;
    v_got bigint;
    v_k bigint;
BEGIN
    SELECT g.capacity, g.lanes, coalesce(pg_sequence_last_value(g.push_seq), 0) INTO v_cap, v_lanes, v_hi
    FROM {schema}.rings g WHERE g.queue_id = p_queue_id;
    SELECT array_agg(l.pos ORDER BY l.lane), min(l.pos) INTO v_pos, v_lo
    FROM {schema}.ring_lanes l WHERE l.queue_id = p_gid;
    IF v_cap IS NULL OR v_lo IS NULL OR p_n < 1 THEN
        RETURN;
    END IF;
    RETURN QUERY
    SELECT r.id, r.attempts, r.deliveries, s.enqueued_at, s.payload
    FROM {schema}.ring_retry r
    JOIN {schema}.ring_slots s ON s.queue_id = p_queue_id AND s.slot = (r.id % v_cap)::integer
    WHERE r.queue_id = p_gid AND r.state = 1 AND r.due_at <= now()
    ORDER BY r.id LIMIT p_n;
    GET DIAGNOSTICS v_got = ROW_COUNT;
    IF v_got >= p_n OR v_hi < v_lo THEN
        RETURN;
    END IF;
    v_a := (v_lo % v_cap)::integer;
    v_span := least(v_cap::bigint, v_hi - v_lo + 1);
    RETURN QUERY
    SELECT s.seq, 0, 0, s.enqueued_at, s.payload
    FROM {schema}.ring_slots s
    WHERE s.queue_id = p_queue_id AND s.slot >= v_a AND s.slot < least(v_cap::bigint, v_a + v_span)
      AND s.payload IS NOT NULL AND s.seq >= v_pos[(s.seq % v_lanes)::integer + 1] AND s.seq <= v_hi
    ORDER BY s.slot LIMIT p_n - v_got;
    GET DIAGNOSTICS v_k = ROW_COUNT;
    v_got := v_got + v_k;
    IF v_got >= p_n OR v_a + v_span <= v_cap THEN
        RETURN;
    END IF;
    RETURN QUERY
    SELECT s.seq, 0, 0, s.enqueued_at, s.payload
    FROM {schema}.ring_slots s
    WHERE s.queue_id = p_queue_id AND s.slot >= 0 AND s.slot < v_a + v_span - v_cap
      AND s.payload IS NOT NULL AND s.seq >= v_pos[(s.seq % v_lanes)::integer + 1] AND s.seq <= v_hi
    ORDER BY s.slot LIMIT p_n - v_got;
END
$$;

-- Grants (schema.sql's grants table and policies): the queues, and their consumer groups' gids, on
-- which p_role (or a role it is a member of) holds p_action ('any': any action), every queue's when it
-- holds it on every queue. An action implies another: admin implies pop and read, pop implies read.
-- Security definer, for the policies of roles that may not read grants themselves; its search_path is
-- pinned, so nothing a caller creates can stand in for what it calls.
CREATE OR REPLACE FUNCTION {schema}.may(p_action text, p_role name)
RETURNS integer[] LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    WITH held AS (
        SELECT g.queue_id FROM {schema}.grants g
        WHERE pg_has_role(p_role, g.role, 'USAGE')
          AND (p_action = 'any' OR g.action = p_action
               OR (p_action IN ('pop', 'read') AND g.action = 'admin')
               OR (p_action = 'read' AND g.action = 'pop'))
    ), ids AS (
        SELECT q.queue_id FROM {schema}.queues q
        WHERE EXISTS (SELECT 1 FROM held WHERE held.queue_id IS NULL)
           OR q.queue_id IN (SELECT held.queue_id FROM held)
    )
    SELECT coalesce(array_agg(x), ARRAY[]::integer[]) FROM (
        SELECT queue_id AS x FROM ids
        UNION ALL
        SELECT r.gid FROM {schema}.ring_groups r WHERE r.queue_id IN (SELECT queue_id FROM ids)) u
$$;

-- The roles that hold an action on queue p_queue_id or on every queue: a ring's sequences, made when it
-- is created, go to them (its creator, who owns them, grants them).
CREATE OR REPLACE FUNCTION {schema}.grantees(p_queue_id integer)
RETURNS SETOF name LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT DISTINCT g.role FROM {schema}.grants g WHERE g.queue_id IS NULL OR g.queue_id = p_queue_id
$$;

-- Whether p_role holds p_action on every queue, present and future (a grant whose queue_id is NULL).
CREATE OR REPLACE FUNCTION {schema}.may_all(p_action text, p_role name)
RETURNS boolean LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT EXISTS (
        SELECT 1 FROM {schema}.grants g
        WHERE g.queue_id IS NULL AND pg_has_role(p_role, g.role, 'USAGE')
          AND (g.action = p_action OR (p_action IN ('pop', 'read') AND g.action = 'admin')
               OR (p_action = 'read' AND g.action = 'pop')))
$$;

-- The actions p_role may take on queue p_queue_id (NULL: on every queue): all four for the schema's
-- owner and its members (and a superuser), whom the policies do not restrict.
CREATE OR REPLACE FUNCTION {schema}.actions_on(p_queue_id integer, p_role name)
RETURNS text[] LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE
        WHEN pg_has_role(p_role, (SELECT n.nspowner FROM pg_namespace n WHERE n.oid = '{schema}'::regnamespace), 'USAGE')
          OR (SELECT r.rolsuper OR r.rolbypassrls FROM pg_roles r WHERE r.rolname = p_role)
        THEN ARRAY['push', 'pop', 'read', 'admin']
        ELSE ARRAY(
            SELECT a FROM unnest(ARRAY['push', 'pop', 'read', 'admin']) a
            WHERE CASE WHEN p_queue_id IS NULL THEN {schema}.may_all(a, p_role)
                       ELSE p_queue_id = ANY ({schema}.may(a, p_role)) END)
    END
$$;
-- The ring's rows layout (ring_rows): a ring whose rows are pushes, not slots, so that its hot path
-- writes no dead row, after PgQ's insert-only event tables rotated with TRUNCATE. A push of n messages
-- is ONE row (r, n, enqueued_at, payloads bytea[]) of a segment table; message k (0-based) of row r
-- has the id (r << 16) | k, so ids rise in push order. Rows are numbered by the ring's row sequence;
-- row r lives in segment table rq_k, k = (r / S) % 4 (S = seg_rows, a quarter of the capacity in
-- rows), which holds one generation r / S at a time (its label: a sequence a segment, rgen_k). Lanes
-- deal rows (lane r % lanes). A lane's position (the id where it goes on) is the highest entry of an
-- insert-only log (rpos_k, the segment of the last row the lane took from); pos_gen (a sequence: set
-- without a dead row) names the newest generation any pop logged in, where a pop looks first. A push
-- that enters a segment not labelled its generation yet takes nothing and names the generation to
-- rotate in: the caller empties that segment (its rows and its log, TRUNCATE under a 50 ms
-- lock_timeout, in a transaction of its own) once every lane is past it, labels it, and pushes again.
-- Nothing on the hot path or in a rotation updates or deletes a row.
--
-- Expiry (a ring created with a ttl): a push with a ttl writes its row's expires_at (@Ppushx); a pop
-- passes an expired row at the head of a lane and records its messages (@Pexpire), and a message due
-- again after its expiry gets a failed or finished retry row instead of a delivery (@Pagain). The lines
-- of the template that only such a ring has begin with @E, which making a ring's objects replaces with
-- nothing, or with a comment's start for a ring without a ttl: its column and statements are then
-- those of a ring that has no expiry at all.
--
-- At least once: a pop inserts a lease row (rl_k, the segment of its first message: its first and last
-- ids, each moved lane's taken range [start, end), its end), and an ack of that whole pop a done row
-- naming it (rd_k, keyed by the lease, so it is closed once). An open lease is one without a done row.
-- A lease is split (closed, and each of its messages given a row leased as before) before some of its
-- messages are acked, nacked or reclaimed alone; a message's delivery state is then its newest row in
-- the retry log of its segment (rr_k, keyed (id, ver): each change writes ver + 1, so two changes from
-- one state cannot both be written). A rotation empties a segment only when no open lease and no
-- message ready or leased again is left in it, and the segment before it was emptied first.
--
-- Each ring has its own tables, sequences and functions (TRUNCATE needs tables of its own), named
-- ring_<queue_id>_r*, made from the template below by ring_rows_create and dropped by ring_rows_drop;
-- the client calls the hot ones (push, pop, the ack of a whole pop) by their names, the functions below
-- without a number call the others by the ring's queue_id (EXECUTE: a call planned on every run). A gap (a push that took its row number and rolled back, or died) is
-- given up by ring_rows_gaps once every transaction that was running when it was first seen has ended:
-- a push takes its transaction id before its row number, so such a row can never be written later.
CREATE OR REPLACE FUNCTION {schema}.ring_rows_template() RETURNS text LANGUAGE sql IMMUTABLE AS $t$ SELECT $x$
CREATE SEQUENCE {schema}.@Pgen0 AS bigint MINVALUE 0 CACHE 1
@;
CREATE SEQUENCE {schema}.@Pgen1 AS bigint MINVALUE 0 CACHE 1
@;
CREATE SEQUENCE {schema}.@Pgen2 AS bigint MINVALUE 0 CACHE 1
@;
CREATE SEQUENCE {schema}.@Pgen3 AS bigint MINVALUE 0 CACHE 1
@;
SELECT setval(format('{schema}.%I', '@Pgen' || k), k) FROM generate_series(0, 3) k
@;
CREATE SEQUENCE {schema}.@Prows AS bigint MINVALUE 0 START 0 CACHE 1
@;
CREATE SEQUENCE {schema}.@Pposgen AS bigint MINVALUE 0 START 0 CACHE 1
@;
CREATE SEQUENCE {schema}.@Pretrygen AS bigint MINVALUE 0 START 0 CACHE 1
@;
CREATE TABLE {schema}.@Pq0 (r bigint NOT NULL, n integer NOT NULL, enqueued_at timestamptz NOT NULL,
    payloads bytea[] NOT NULL,
@E    expires_at timestamptz,
    CONSTRAINT @Pq0_pkey PRIMARY KEY (r))
@;
CREATE TABLE {schema}.@Pq1 (LIKE {schema}.@Pq0 INCLUDING ALL)
@;
CREATE TABLE {schema}.@Pq2 (LIKE {schema}.@Pq0 INCLUDING ALL)
@;
CREATE TABLE {schema}.@Pq3 (LIKE {schema}.@Pq0 INCLUDING ALL)
@;
CREATE TABLE {schema}.@Ppos0 (lane integer NOT NULL, at bigint NOT NULL,
@O    lo bigint,
    CONSTRAINT @Ppos0_pkey PRIMARY KEY (lane, at))
@;
CREATE TABLE {schema}.@Ppos1 (LIKE {schema}.@Ppos0 INCLUDING ALL)
@;
CREATE TABLE {schema}.@Ppos2 (LIKE {schema}.@Ppos0 INCLUDING ALL)
@;
CREATE TABLE {schema}.@Ppos3 (LIKE {schema}.@Ppos0 INCLUDING ALL)
@;
CREATE TABLE {schema}.@Pl0 (lo bigint NOT NULL, hi bigint NOT NULL, n integer NOT NULL,
    starts bigint[] NOT NULL, ends bigint[] NOT NULL, lease_until timestamptz NOT NULL, consumer text,
    CONSTRAINT @Pl0_pkey PRIMARY KEY (lo))
@;
CREATE TABLE {schema}.@Pl1 (LIKE {schema}.@Pl0 INCLUDING ALL)
@;
CREATE TABLE {schema}.@Pl2 (LIKE {schema}.@Pl0 INCLUDING ALL)
@;
CREATE TABLE {schema}.@Pl3 (LIKE {schema}.@Pl0 INCLUDING ALL)
@;
CREATE TABLE {schema}.@Pd0 (lo bigint NOT NULL, CONSTRAINT @Pd0_pkey PRIMARY KEY (lo))
@;
CREATE TABLE {schema}.@Pd1 (LIKE {schema}.@Pd0 INCLUDING ALL)
@;
CREATE TABLE {schema}.@Pd2 (LIKE {schema}.@Pd0 INCLUDING ALL)
@;
CREATE TABLE {schema}.@Pd3 (LIKE {schema}.@Pd0 INCLUDING ALL)
@;
CREATE TABLE {schema}.@Pr0 (id bigint NOT NULL, ver integer NOT NULL, state smallint NOT NULL,
    attempts integer NOT NULL, deliveries integer NOT NULL, due_at timestamptz NOT NULL, consumer text,
    last_error text, CONSTRAINT @Pr0_pkey PRIMARY KEY (id, ver))
@;
CREATE TABLE {schema}.@Pr1 (LIKE {schema}.@Pr0 INCLUDING ALL)
@;
CREATE TABLE {schema}.@Pr2 (LIKE {schema}.@Pr0 INCLUDING ALL)
@;
CREATE TABLE {schema}.@Pr3 (LIKE {schema}.@Pr0 INCLUDING ALL)
@;
CREATE VIEW {schema}.@Pl AS
    SELECT * FROM {schema}.@Pl0 UNION ALL SELECT * FROM {schema}.@Pl1
    UNION ALL SELECT * FROM {schema}.@Pl2 UNION ALL SELECT * FROM {schema}.@Pl3
@;
CREATE VIEW {schema}.@Pd AS
    SELECT * FROM {schema}.@Pd0 UNION ALL SELECT * FROM {schema}.@Pd1
    UNION ALL SELECT * FROM {schema}.@Pd2 UNION ALL SELECT * FROM {schema}.@Pd3
@;
CREATE VIEW {schema}.@Pr AS
    SELECT r.* FROM (
        SELECT * FROM {schema}.@Pr0 UNION ALL SELECT * FROM {schema}.@Pr1
        UNION ALL SELECT * FROM {schema}.@Pr2 UNION ALL SELECT * FROM {schema}.@Pr3) r
@;
ALTER TABLE {schema}.@Pq0 ALTER COLUMN payloads SET STORAGE EXTERNAL
@;
ALTER TABLE {schema}.@Pq1 ALTER COLUMN payloads SET STORAGE EXTERNAL
@;
ALTER TABLE {schema}.@Pq2 ALTER COLUMN payloads SET STORAGE EXTERNAL
@;
ALTER TABLE {schema}.@Pq3 ALTER COLUMN payloads SET STORAGE EXTERNAL
@;
INSERT INTO {schema}.@Ppos0 SELECT k, (k::bigint << 16) FROM generate_series(0, @L - 1) k
@;
CREATE VIEW {schema}.@Pq AS
    SELECT * FROM {schema}.@Pq0 UNION ALL SELECT * FROM {schema}.@Pq1
    UNION ALL SELECT * FROM {schema}.@Pq2 UNION ALL SELECT * FROM {schema}.@Pq3
@;
-- The position logs of the four segments (read by @Pholds on a ring ordered per key).
CREATE VIEW {schema}.@Ppos AS
    SELECT * FROM {schema}.@Ppos0 UNION ALL SELECT * FROM {schema}.@Ppos1
    UNION ALL SELECT * FROM {schema}.@Ppos2 UNION ALL SELECT * FROM {schema}.@Ppos3
@;
-- The messages of every segment emptied so far (the push total's part that TRUNCATE took away), one
-- row a segment: a rotation reads the newest (the highest total), adds the messages of the segment it
-- empties, and writes the sum into that segment's table, emptied with it by the same TRUNCATE. So the
-- count commits or rolls back with the emptying, a rotation run again on an emptied segment adds
-- nothing, and nothing is updated or deleted. No row before the first rotation.
CREATE TABLE {schema}.@Pemptied0 (total bigint NOT NULL)
@;
CREATE TABLE {schema}.@Pemptied1 (LIKE {schema}.@Pemptied0 INCLUDING ALL)
@;
CREATE TABLE {schema}.@Pemptied2 (LIKE {schema}.@Pemptied0 INCLUDING ALL)
@;
CREATE TABLE {schema}.@Pemptied3 (LIKE {schema}.@Pemptied0 INCLUDING ALL)
@;
CREATE VIEW {schema}.@Pemptied AS
    SELECT * FROM {schema}.@Pemptied0 UNION ALL SELECT * FROM {schema}.@Pemptied1
    UNION ALL SELECT * FROM {schema}.@Pemptied2 UNION ALL SELECT * FROM {schema}.@Pemptied3
@;
-- The ring's batches (not segmented: a batch is remembered after its segment is emptied, until the
-- upkeep forgets it): one row a claim (its receipts in id order, grp the key of its consumer group), and
-- one row a change of its state (bs: claimed again with a later lease end, acked, released), the highest
-- ver being its state. Claims and acks only insert.
CREATE TABLE {schema}.@Pb (batch_id uuid NOT NULL, grp integer NOT NULL, ids bigint[] NOT NULL,
    deliveries integer[] NOT NULL, consumer text, claimed_at timestamptz NOT NULL,
    lease_until timestamptz NOT NULL, CONSTRAINT @Pb_pkey PRIMARY KEY (batch_id))
@;
CREATE INDEX @Pb_claimed_idx ON {schema}.@Pb (grp, claimed_at)
@;
CREATE TABLE {schema}.@Pbs (batch_id uuid NOT NULL, ver integer NOT NULL, state smallint NOT NULL,
    lease_until timestamptz NOT NULL, finished_at timestamptz, last_error text,
    CONSTRAINT @Pbs_pkey PRIMARY KEY (batch_id, ver))
@;
-- The ring's deduplication keys (push(dedup_key=...), @Ppushk): one row a key, the id of the message
-- its first push within the queue's dedup_window_s made, and when. Written only by pushes that carry
-- keys (a push without keys never reads it) and forgotten by the upkeep (@Pforget, through
-- @Pkeys_pushed_idx), so it holds about a window of keys. Not segmented: a key outlives its message's
-- segment, as the table design's outlives its message. The ring's, not a group's: groups never copy it.
-- Half of each page is left to updates (fillfactor 50), so that a push's update of the keys it
-- inserted (their ids, below) finds room on their page: a HOT update, which adds no index entry.
CREATE TABLE {schema}.@Pkeys (dedup_key text NOT NULL, id bigint, pushed_at timestamptz NOT NULL,
    CONSTRAINT @Pkeys_pkey PRIMARY KEY (dedup_key)) WITH (fillfactor = 50)
@;
CREATE INDEX @Pkeys_pushed_idx ON {schema}.@Pkeys (pushed_at)
@;
-- The positions of lanes p_lanes (all when NULL), in that order: each lane's highest log entry, first in
-- the newest segment any pop logged in, then older ones for the lanes not found there.
CREATE FUNCTION {schema}.@Planes(p_lanes integer[]) RETURNS bigint[] LANGUAGE plpgsql AS $b$
DECLARE
    v_lanes integer[] := coalesce(p_lanes, ARRAY(SELECT generate_series(0, @L - 1)));
    v_at bigint[];
    v_newest integer := (coalesce(pg_sequence_last_value('{schema}.@Pposgen'), 0) % 4)::integer;
    v_k integer;
BEGIN
    v_k := v_newest;
    v_at := array_fill(NULL::bigint, ARRAY[cardinality(v_lanes)]);
    FOR i IN 1 .. 4 LOOP
        IF v_k = 0 THEN
            SELECT array_agg(coalesce(u.at, (SELECT max(p.at) FROM {schema}.@Ppos0 p WHERE p.lane = u.k)) ORDER BY u.o) INTO v_at FROM unnest(v_lanes, v_at) WITH ORDINALITY u(k, at, o);
        ELSIF v_k = 1 THEN
            SELECT array_agg(coalesce(u.at, (SELECT max(p.at) FROM {schema}.@Ppos1 p WHERE p.lane = u.k)) ORDER BY u.o) INTO v_at FROM unnest(v_lanes, v_at) WITH ORDINALITY u(k, at, o);
        ELSIF v_k = 2 THEN
            SELECT array_agg(coalesce(u.at, (SELECT max(p.at) FROM {schema}.@Ppos2 p WHERE p.lane = u.k)) ORDER BY u.o) INTO v_at FROM unnest(v_lanes, v_at) WITH ORDINALITY u(k, at, o);
        ELSE
            SELECT array_agg(coalesce(u.at, (SELECT max(p.at) FROM {schema}.@Ppos3 p WHERE p.lane = u.k)) ORDER BY u.o) INTO v_at FROM unnest(v_lanes, v_at) WITH ORDINALITY u(k, at, o);
        END IF;
        EXIT WHEN array_position(v_at, NULL) IS NULL;
        v_k := (v_k + 3) % 4;
    END LOOP;
    RETURN v_at;
END
$b$
@;
-- Log lane positions p_at (ids) of lanes p_lanes, each in the segment of the row it names (or of the
-- row before it in the lane, when that row's segment is not the next generation's yet), and raise
-- pos_gen to the newest generation logged in. The row a position names is at most a lane past the
-- last row taken, so its segment is the taken row's or the next one. On a ring ordered per key each
-- entry also names p_lo, the lease that took the lane's messages up to that position (NULL: none, a pop
-- at most once or a lane that only passed rows), which @Pholds reads; only such a ring's position logs
-- have that column.
CREATE FUNCTION {schema}.@Plog(p_lanes integer[], p_at bigint[]
@O    , p_lo bigint DEFAULT NULL
    ) RETURNS void LANGUAGE plpgsql AS $b$
DECLARE
    v_seg integer[];
    v_gen bigint := 0;
    v_r bigint;
BEGIN
    v_seg := array_fill(NULL::integer, ARRAY[cardinality(p_lanes)]);
    FOR i IN 1 .. cardinality(p_lanes) LOOP
        v_r := p_at[i] >> 16;
        IF (p_at[i] & 65535) = 0 THEN
            v_r := v_r - @L;  -- the row taken last: its segment is live (the floor holds it)
        END IF;
        v_seg[i] := (v_r / @S % 4)::integer;
        v_gen := greatest(v_gen, v_r / @S);
    END LOOP;
    FOR k IN 0 .. 3 LOOP
        CONTINUE WHEN NOT (k = ANY (v_seg));
        IF k = 0 THEN
            INSERT INTO {schema}.@Ppos0 SELECT u.l, u.a
@O              , p_lo
                FROM unnest(p_lanes, p_at, v_seg) u(l, a, s) WHERE u.s = 0 ON CONFLICT DO NOTHING;
        ELSIF k = 1 THEN
            INSERT INTO {schema}.@Ppos1 SELECT u.l, u.a
@O              , p_lo
                FROM unnest(p_lanes, p_at, v_seg) u(l, a, s) WHERE u.s = 1 ON CONFLICT DO NOTHING;
        ELSIF k = 2 THEN
            INSERT INTO {schema}.@Ppos2 SELECT u.l, u.a
@O              , p_lo
                FROM unnest(p_lanes, p_at, v_seg) u(l, a, s) WHERE u.s = 2 ON CONFLICT DO NOTHING;
        ELSE
            INSERT INTO {schema}.@Ppos3 SELECT u.l, u.a
@O              , p_lo
                FROM unnest(p_lanes, p_at, v_seg) u(l, a, s) WHERE u.s = 3 ON CONFLICT DO NOTHING;
        END IF;
    END LOOP;
    -- Raised under a lock, so it only rises; before the pop commits, so a lane's newest log entry is
    -- never in a newer segment than it says. A pop that rolls back may leave it raised: lanes not found
    -- in the newest segment are then looked up in the older ones.
    IF v_gen > coalesce(pg_sequence_last_value('{schema}.@Pposgen'), 0) THEN
        PERFORM pg_advisory_xact_lock(@K3, 0);
        IF v_gen > coalesce(pg_sequence_last_value('{schema}.@Pposgen'), 0) THEN
            PERFORM setval('{schema}.@Pposgen', v_gen);
        END IF;
    END IF;
END
$b$
@;
-- Which lanes of a ring ordered per key a pop may not take from now, one a lane (index lane + 1):
-- 1 held, 2 free with messages due again (to deliver before the lane's rows), 0 free. A lane is held
-- while a message taken from it is not finished: the lease named by its newest position entry is open
-- (its row is there and no done row: a pop takes from a free lane only, so every older lease of the
-- lane is closed; a lease whose segment was emptied was closed, as a rotation empties none open), or a
-- message of the lane is leased again or waits for its due time (a nack's delay) in the retry log.
-- Messages due again come first in their lane: they were taken from it before anything it still holds.
-- Each lane's newest entry is one index scan a segment (the view's merge of them); the retry log is
-- read whole (it holds only the messages acked, nacked or reclaimed apart from their pop's whole ack).
CREATE FUNCTION {schema}.@Pholds() RETURNS smallint[] LANGUAGE plpgsql AS $b$
DECLARE
    v_hold smallint[];
    rec record;
BEGIN
    SELECT array_agg(CASE WHEN x.lo IS NOT NULL AND EXISTS (SELECT 1 FROM {schema}.@Pl e WHERE e.lo = x.lo)
                           AND NOT EXISTS (SELECT 1 FROM {schema}.@Pd d WHERE d.lo = x.lo)
                          THEN 1 ELSE 0 END::smallint ORDER BY g)
    INTO v_hold
    FROM generate_series(0, @L - 1) g
    LEFT JOIN LATERAL (SELECT p.lo FROM {schema}.@Ppos p WHERE p.lane = g ORDER BY p.at DESC LIMIT 1) x ON true;
    FOR rec IN
        SELECT ((r.id >> 16) % @L)::integer AS lane, bool_or(r.state = 2 OR r.due_at > now()) AS busy
        FROM {schema}.@Pr r
        WHERE r.state IN (1, 2) AND NOT EXISTS (SELECT 1 FROM {schema}.@Pr x WHERE x.id = r.id AND x.ver > r.ver)
        GROUP BY 1
    LOOP
        v_hold[rec.lane + 1] := CASE WHEN rec.busy OR v_hold[rec.lane + 1] = 1 THEN 1 ELSE 2 END;
    END LOOP;
    RETURN v_hold;
END
$b$
@;
-- Which lanes of a ring ordered per key hold their waiting messages back from a pop now, one a lane
-- (index lane + 1), for the observers (@Pready, @Plook, @Pdepth), given each lane's position p_at as the
-- caller read it: the lease named by the lane's entry at p_at (its newest) is open and not past its end,
-- or a message of the lane is leased again or waits for its due time (its newest retry row leased or
-- ready from a time still to come). What @Pholds tells a pop, except that a lease or a leased retry row
-- past its end holds nothing here: a pop reclaims it first (@Preclaim), which frees its lane. STABLE, so
-- its statement reads the snapshot of the statement that calls it. Its cost: a probe of the position
-- log, the leases and the done rows a lane (index scans by key), and the retry log read whole, as
-- @Pholds reads it (it holds only the messages settled apart from their pop's whole ack). On a ring
-- without ordering per key (its position logs name no lease) only the retry log's part is there, and
-- nothing calls it.
CREATE FUNCTION {schema}.@Pblocked(p_at bigint[]) RETURNS boolean[] LANGUAGE sql STABLE AS $b$
    WITH b AS MATERIALIZED (
        SELECT DISTINCT ((r.id >> 16) % @L)::integer AS lane FROM {schema}.@Pr r
        WHERE r.state IN (1, 2) AND r.due_at > now()
          AND NOT EXISTS (SELECT 1 FROM {schema}.@Pr x WHERE x.id = r.id AND x.ver > r.ver))
    SELECT array_agg(((u.o - 1)::integer IN (SELECT b.lane FROM b)
@O      OR EXISTS (SELECT 1 FROM {schema}.@Ppos p JOIN {schema}.@Pl e ON e.lo = p.lo
@O                 WHERE p.lane = u.o - 1 AND p.at = u.at AND e.lease_until > now()
@O                   AND NOT EXISTS (SELECT 1 FROM {schema}.@Pd d WHERE d.lo = e.lo))
        ) ORDER BY u.o)
    FROM unnest(p_at) WITH ORDINALITY u(at, o)
$b$
@;
-- The generation segment p_k holds (a sequence a segment, set by ring_rows_label: no dead row).
CREATE FUNCTION {schema}.@Pseg_gen(p_k integer) RETURNS bigint LANGUAGE sql AS $b$
    SELECT CASE p_k WHEN 0 THEN pg_sequence_last_value('{schema}.@Pgen0')
                    WHEN 1 THEN pg_sequence_last_value('{schema}.@Pgen1')
                    WHEN 2 THEN pg_sequence_last_value('{schema}.@Pgen2')
                    ELSE pg_sequence_last_value('{schema}.@Pgen3') END
$b$
@;
-- The floor in rows: the lowest row a lane still needs.
CREATE FUNCTION {schema}.@Pfloor() RETURNS bigint LANGUAGE sql AS $b$
    SELECT min(x >> 16) FROM unnest({schema}.@Planes(NULL)) x
$b$
@;
-- Push a batch as one row in the caller's transaction. r_first: the row's first id; or NULL with r_need,
-- the generation to rotate in first (nothing taken). The transaction id is taken before the row number
-- (see ring_rows_gaps), and the number under a session lock held for the check and nextval, so a push
-- never holds a number whose segment is not its generation's.
CREATE FUNCTION {schema}.@Ppush(p_payloads bytea[], p_notify integer, p_channel text,
    OUT r_first bigint, OUT r_need bigint) LANGUAGE plpgsql AS $b$
DECLARE
    v_r bigint;
    v_k integer;
    v_ok boolean;
BEGIN
    v_ok := pg_current_xact_id() IS NOT NULL;
    v_ok := pg_advisory_lock(@K1, 0) IS NULL;
    v_r := coalesce(pg_sequence_last_value('{schema}.@Prows'), -1) + 1;
    v_k := (v_r / @S % 4)::integer;
    IF {schema}.@Pseg_gen(v_k) <> v_r / @S THEN
        v_ok := pg_advisory_unlock(@K1, 0);
        r_need := v_r / @S;
        RETURN;
    END IF;
    v_r := nextval('{schema}.@Prows');
    v_ok := pg_advisory_unlock(@K1, 0);
    IF v_k = 0 THEN
        INSERT INTO {schema}.@Pq0 VALUES (v_r, cardinality(p_payloads), now(), p_payloads);
    ELSIF v_k = 1 THEN
        INSERT INTO {schema}.@Pq1 VALUES (v_r, cardinality(p_payloads), now(), p_payloads);
    ELSIF v_k = 2 THEN
        INSERT INTO {schema}.@Pq2 VALUES (v_r, cardinality(p_payloads), now(), p_payloads);
    ELSE
        INSERT INTO {schema}.@Pq3 VALUES (v_r, cardinality(p_payloads), now(), p_payloads);
    END IF;
    r_first := v_r << 16;
    -- auto: when no lane of the default group, or of another group, still needs a row before ours (its
    -- consumers caught up: they may be waiting). The other groups are read only when the default one
    -- is behind; never: one comparison.
    IF p_notify > 0 THEN
        IF p_notify = 2 OR {schema}.@Pfloor() >= v_r OR {schema}.ring_rows_caught_up(@Q, v_r) THEN
            PERFORM pg_notify(p_channel, '');
        END IF;
    END IF;
END
$b$
@;
-- @Ppush for a push with a time to live (a ring created with a ttl): its row carries its expiry,
-- now() + p_ttl seconds, which the pops compare (@Ptake). A function of its own, so that a push without
-- one runs @Ppush as before.
CREATE FUNCTION {schema}.@Ppushx(p_payloads bytea[], p_notify integer, p_channel text, p_ttl double precision,
    OUT r_first bigint, OUT r_need bigint) LANGUAGE plpgsql AS $b$
DECLARE
    v_r bigint;
    v_k integer;
    v_ok boolean;
BEGIN
    v_ok := pg_current_xact_id() IS NOT NULL;
    v_ok := pg_advisory_lock(@K1, 0) IS NULL;
    v_r := coalesce(pg_sequence_last_value('{schema}.@Prows'), -1) + 1;
    v_k := (v_r / @S % 4)::integer;
    IF {schema}.@Pseg_gen(v_k) <> v_r / @S THEN
        v_ok := pg_advisory_unlock(@K1, 0);
        r_need := v_r / @S;
        RETURN;
    END IF;
    v_r := nextval('{schema}.@Prows');
    v_ok := pg_advisory_unlock(@K1, 0);
    IF v_k = 0 THEN
        INSERT INTO {schema}.@Pq0 VALUES (v_r, cardinality(p_payloads), now(), p_payloads, now() + make_interval(secs => p_ttl));
    ELSIF v_k = 1 THEN
        INSERT INTO {schema}.@Pq1 VALUES (v_r, cardinality(p_payloads), now(), p_payloads, now() + make_interval(secs => p_ttl));
    ELSIF v_k = 2 THEN
        INSERT INTO {schema}.@Pq2 VALUES (v_r, cardinality(p_payloads), now(), p_payloads, now() + make_interval(secs => p_ttl));
    ELSE
        INSERT INTO {schema}.@Pq3 VALUES (v_r, cardinality(p_payloads), now(), p_payloads, now() + make_interval(secs => p_ttl));
    END IF;
    r_first := v_r << 16;
    -- auto: when no lane of the default group, or of another group, still needs a row before ours (its
    -- consumers caught up: they may be waiting). The other groups are read only when the default one
    -- is behind; never: one comparison.
    IF p_notify > 0 THEN
        IF p_notify = 2 OR {schema}.@Pfloor() >= v_r OR {schema}.ring_rows_caught_up(@Q, v_r) THEN
            PERFORM pg_notify(p_channel, '');
        END IF;
    END IF;
END
$b$
@;
-- Push a batch with deduplication keys (p_keys[i] the key of p_payloads[i], distinct: the client maps a
-- key repeated within a batch to its first occurrence) in the caller's transaction; p_ttl: the messages'
-- time to live (NULL: none; only a ring created with a ttl has the column). r_ids: each payload's id, in
-- payload order: a key pushed within the queue's dedup_window_s returns the id its first push made
-- (whether or not it was consumed since) and pushes nothing; the payloads of the other keys are pushed
-- as ONE row, in payload order, their ids following from its number. Nothing when every key is known:
-- no row number is taken, and no room is needed (a retry into a full ring gets its ids at once). Or
-- r_need as @Ppush's, nothing pushed and no key kept.
-- The keys are claimed BEFORE the row number is taken: each by an INSERT into @Pkeys (id NULL) whose ON
-- CONFLICT takes over a row older than the window and otherwise only locks it, in key order (two
-- batches sharing keys lock them in one order). Two pushes of one key in separate transactions meet on
-- @Pkeys_pkey: the second waits for the first's transaction there, holding no row number, so it leaves
-- no gap whatever the first does. If the first committed, the second's ON CONFLICT finds its row and
-- the SELECT after it (READ COMMITTED: a snapshot of its own) reads its id; if it rolled back, the second
-- inserts its own row and pushes. Under REPEATABLE READ or SERIALIZABLE a key committed after the
-- transaction's snapshot raises a serialization error (the caller runs its transaction again). The
-- claimed rows get their ids once the row number is taken; a rotation needed by then deletes them again
-- (a row taken over was older than the window: as good as absent) and asks for it. The claimed rows are
-- found again by the row versions the claim returned (a TID scan of exactly those): the table holds a
-- window's keys, which no push of new keys reads.
CREATE FUNCTION {schema}.@Ppushk(p_payloads bytea[], p_keys text[], p_notify integer, p_channel text,
    p_ttl double precision, OUT r_ids bigint[], OUT r_need bigint) LANGUAGE plpgsql AS $b$
DECLARE
    v_r bigint;
    v_k integer;
    v_ok boolean;
    v_window double precision;
    v_new bigint[];
    v_tids tid[];
    v_pl bytea[];
BEGIN
    v_ok := pg_current_xact_id() IS NOT NULL;
    SELECT q.dedup_window_s INTO v_window FROM {schema}.queues q WHERE q.queue_id = @Q;
    v_r := coalesce(pg_sequence_last_value('{schema}.@Prows'), -1) + 1;
    IF {schema}.@Pseg_gen((v_r / @S % 4)::integer) <> v_r / @S THEN
        -- Asked before any key is claimed. A push whose keys are all known (committed within the window,
        -- as its snapshot shows them) needs no row: their ids, full ring or not.
        r_ids := ARRAY(SELECT d.id FROM unnest(p_keys) WITH ORDINALITY AS u(k, o)
                       JOIN {schema}.@Pkeys d ON d.dedup_key = u.k
                       WHERE d.pushed_at > now() - make_interval(secs => v_window) AND d.id IS NOT NULL
                       ORDER BY u.o);
        IF cardinality(r_ids) = cardinality(p_keys) THEN
            RETURN;
        END IF;
        r_ids := NULL;
        r_need := v_r / @S;
        RETURN;
    END IF;
    WITH c AS (
        INSERT INTO {schema}.@Pkeys AS d (dedup_key, id, pushed_at)
        SELECT u.k, NULL, now() FROM unnest(p_keys) AS u(k) ORDER BY u.k
        ON CONFLICT (dedup_key) DO UPDATE SET id = NULL, pushed_at = excluded.pushed_at
        WHERE d.pushed_at <= now() - make_interval(secs => v_window)
        RETURNING d.dedup_key, d.ctid)
    SELECT array_agg(u.o ORDER BY u.o), array_agg(c.ctid ORDER BY u.o) INTO v_new, v_tids
    FROM unnest(p_keys) WITH ORDINALITY AS u(k, o) JOIN c ON c.dedup_key = u.k;
    IF v_new IS NULL THEN  -- every key known: their first pushes' ids, nothing pushed
        r_ids := ARRAY(SELECT d.id FROM unnest(p_keys) WITH ORDINALITY AS u(k, o)
                       JOIN {schema}.@Pkeys d ON d.dedup_key = u.k ORDER BY u.o);
        RETURN;
    END IF;
    v_pl := ARRAY(SELECT p_payloads[x.o] FROM unnest(v_new) WITH ORDINALITY AS x(o, i) ORDER BY x.i);
    v_ok := pg_advisory_lock(@K1, 0) IS NULL;
    v_r := coalesce(pg_sequence_last_value('{schema}.@Prows'), -1) + 1;
    v_k := (v_r / @S % 4)::integer;
    IF {schema}.@Pseg_gen(v_k) <> v_r / @S THEN
        v_ok := pg_advisory_unlock(@K1, 0);
        DELETE FROM {schema}.@Pkeys d WHERE d.ctid = ANY (v_tids);
        r_need := v_r / @S;
        RETURN;
    END IF;
    v_r := nextval('{schema}.@Prows');
    v_ok := pg_advisory_unlock(@K1, 0);
    IF v_k = 0 THEN
        INSERT INTO {schema}.@Pq0 VALUES (v_r, cardinality(v_pl), now(), v_pl
@E          , now() + make_interval(secs => p_ttl)
        );
    ELSIF v_k = 1 THEN
        INSERT INTO {schema}.@Pq1 VALUES (v_r, cardinality(v_pl), now(), v_pl
@E          , now() + make_interval(secs => p_ttl)
        );
    ELSIF v_k = 2 THEN
        INSERT INTO {schema}.@Pq2 VALUES (v_r, cardinality(v_pl), now(), v_pl
@E          , now() + make_interval(secs => p_ttl)
        );
    ELSE
        INSERT INTO {schema}.@Pq3 VALUES (v_r, cardinality(v_pl), now(), v_pl
@E          , now() + make_interval(secs => p_ttl)
        );
    END IF;
    UPDATE {schema}.@Pkeys d SET id = (v_r << 16) | (x.i - 1)
    FROM unnest(v_tids) WITH ORDINALITY AS x(t, i) WHERE d.ctid = x.t;
    IF cardinality(v_new) = cardinality(p_keys) THEN
        r_ids := ARRAY(SELECT (v_r << 16) | i FROM generate_series(0, cardinality(p_keys) - 1) i);
    ELSE
        r_ids := ARRAY(SELECT d.id FROM unnest(p_keys) WITH ORDINALITY AS u(k, o)
                       JOIN {schema}.@Pkeys d ON d.dedup_key = u.k ORDER BY u.o);
    END IF;
    IF p_notify > 0 THEN  -- as @Ppush
        IF p_notify = 2 OR {schema}.@Pfloor() >= v_r OR {schema}.ring_rows_caught_up(@Q, v_r) THEN
            PERFORM pg_notify(p_channel, '');
        END IF;
    END IF;
END
$b$
@;
-- Push a batch into a ring ordered per key, in the caller's transaction: p_payloads are the batch's
-- messages sorted by lane (stably: each lane's in push order), p_counts[l + 1] how many of them lane l
-- has (the client maps a message's ordering key to a lane, a stable hash of the key modulo the lanes).
-- Every push of such a ring takes a block of @L consecutive row numbers starting at a multiple of @L
-- (under the push lock, the row sequence set to the block's last number: what every reader of the
-- sequence takes for the last row issued), so its row r_first + l is lane l's: it writes each lane's
-- messages as that row (a slice of p_payloads), and an empty row (n = 0) in each lane that has none,
-- which pops pass without delivering, so that no lane waits for a number behind the push. A lane never
-- passes a row issued and not written, so a key's messages are taken in push order. A segment holds a
-- whole number of blocks (the client checks it). p_ttl: the messages' time to live (NULL: none; only a
-- ring created with a ttl has the column). r_first: the block's first row (message k of lane l's row
-- has the id ((r_first + l) << 16) | k, which the client computes); or r_need as @Ppush's, nothing
-- pushed.
CREATE FUNCTION {schema}.@Ppusho(p_payloads bytea[], p_counts integer[], p_notify integer, p_channel text,
    p_ttl double precision, OUT r_first bigint, OUT r_need bigint) LANGUAGE plpgsql AS $b$
DECLARE
    v_r bigint;
    v_k integer;
    v_ok boolean;
    v_from integer[];
BEGIN
    v_ok := pg_current_xact_id() IS NOT NULL;
    v_ok := pg_advisory_lock(@K1, 0) IS NULL;
    v_r := coalesce(pg_sequence_last_value('{schema}.@Prows'), -1) + 1;
    v_k := (v_r / @S % 4)::integer;
    IF {schema}.@Pseg_gen(v_k) <> v_r / @S THEN
        v_ok := pg_advisory_unlock(@K1, 0);
        r_need := v_r / @S;
        RETURN;
    END IF;
    PERFORM setval('{schema}.@Prows', v_r + @L - 1);
    v_ok := pg_advisory_unlock(@K1, 0);
    -- each lane's first place in p_payloads (1-based)
    v_from := ARRAY(SELECT 1 + coalesce(sum(c) OVER (ORDER BY o ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0)
                    FROM unnest(p_counts) WITH ORDINALITY u(c, o) ORDER BY o);
    IF v_k = 0 THEN
        INSERT INTO {schema}.@Pq0 SELECT v_r + g - 1, p_counts[g], now(), p_payloads[v_from[g] : v_from[g] + p_counts[g] - 1]
@E          , now() + make_interval(secs => p_ttl)
            FROM generate_series(1, @L) g;
    ELSIF v_k = 1 THEN
        INSERT INTO {schema}.@Pq1 SELECT v_r + g - 1, p_counts[g], now(), p_payloads[v_from[g] : v_from[g] + p_counts[g] - 1]
@E          , now() + make_interval(secs => p_ttl)
            FROM generate_series(1, @L) g;
    ELSIF v_k = 2 THEN
        INSERT INTO {schema}.@Pq2 SELECT v_r + g - 1, p_counts[g], now(), p_payloads[v_from[g] : v_from[g] + p_counts[g] - 1]
@E          , now() + make_interval(secs => p_ttl)
            FROM generate_series(1, @L) g;
    ELSE
        INSERT INTO {schema}.@Pq3 SELECT v_r + g - 1, p_counts[g], now(), p_payloads[v_from[g] : v_from[g] + p_counts[g] - 1]
@E          , now() + make_interval(secs => p_ttl)
            FROM generate_series(1, @L) g;
    END IF;
    r_first := v_r;
    IF p_notify > 0 THEN  -- as @Ppush
        IF p_notify = 2 OR {schema}.@Pfloor() >= v_r OR {schema}.ring_rows_caught_up(@Q, v_r) THEN
            PERFORM pg_notify(p_channel, '');
        END IF;
    END IF;
END
$b$
@;
-- Forget up to p_n deduplication keys older than the queue's window (the upkeep): a push would take
-- them over anyway. Returns how many.
CREATE FUNCTION {schema}.@Pforget(p_n integer) RETURNS integer LANGUAGE plpgsql AS $b$
DECLARE
    v_n integer;
BEGIN
    DELETE FROM {schema}.@Pkeys d WHERE d.ctid = ANY (ARRAY(
        SELECT k.ctid FROM {schema}.@Pkeys k
        WHERE k.pushed_at <= now() - make_interval(secs => (
            SELECT q.dedup_window_s FROM {schema}.queues q WHERE q.queue_id = @Q))
        ORDER BY k.pushed_at LIMIT p_n));
    GET DIAGNOSTICS v_n = ROW_COUNT;
    RETURN v_n;
END
$b$
@;
-- Empty the segment that generation p_gen needs (holding p_gen - 4), in a transaction of its own, once
-- every lane is past it by a lane's width of rows (so that every lane's newest log entry lies in a later
-- segment): true when it is empty or p_gen's already, false while a lane still needs it or when its lock
-- is not had within 50 ms (a reader still has it open). The caller then labels it p_gen
-- (@Plabel) in a transaction of its own, after this one committed: a push writes into a segment only
-- once it is labelled its generation, so no push writes into it before it is empty, and a crash between
-- the two leaves it empty and unlabelled (the next rotation empties it again). The label is read again
-- under the lock: a rotation that waited for another one's lock finds it done.
CREATE FUNCTION {schema}.@Protate(p_gen bigint) RETURNS boolean
LANGUAGE plpgsql SET lock_timeout = '50ms' AS $b$
DECLARE
    v_k integer := (p_gen % 4)::integer;
    v_total bigint;
BEGIN
    IF {schema}.@Pseg_gen(v_k) >= p_gen THEN
        RETURN true;
    END IF;
    IF {schema}.@Pfloor() < (p_gen - 3) * @S + @L THEN
        RETURN false;
    END IF;
    -- Segments are emptied in generation order: a lease lies in the segment of its first message and
    -- may hold messages of the next one, so the segment before must have been passed (its leases closed,
    -- their messages in the next segment's retry log) first. And nothing of this one may be needed.
    IF {schema}.@Pseg_gen(((p_gen + 3) % 4)::integer) < p_gen - 1 OR {schema}.@Pbusy(v_k) THEN
        RETURN false;
    END IF;
    IF v_k = 0 THEN
        LOCK TABLE {schema}.@Pq0, {schema}.@Ppos0, {schema}.@Pl0, {schema}.@Pd0, {schema}.@Pr0, {schema}.@Pemptied0 IN ACCESS EXCLUSIVE MODE;
    ELSIF v_k = 1 THEN
        LOCK TABLE {schema}.@Pq1, {schema}.@Ppos1, {schema}.@Pl1, {schema}.@Pd1, {schema}.@Pr1, {schema}.@Pemptied1 IN ACCESS EXCLUSIVE MODE;
    ELSIF v_k = 2 THEN
        LOCK TABLE {schema}.@Pq2, {schema}.@Ppos2, {schema}.@Pl2, {schema}.@Pd2, {schema}.@Pr2, {schema}.@Pemptied2 IN ACCESS EXCLUSIVE MODE;
    ELSE
        LOCK TABLE {schema}.@Pq3, {schema}.@Ppos3, {schema}.@Pl3, {schema}.@Pd3, {schema}.@Pr3, {schema}.@Pemptied3 IN ACCESS EXCLUSIVE MODE;
    END IF;
    IF {schema}.@Pseg_gen(v_k) >= p_gen THEN
        RETURN true;
    END IF;
    IF {schema}.@Pbusy(v_k) THEN  -- again under the lock: nothing can make it busy again, but be sure
        RETURN false;
    END IF;
    -- The messages of every segment emptied before, and (below) this one's: counted under the lock,
    -- when no push can write into it, and recorded by the same transaction that empties it.
    v_total := coalesce((SELECT max(e.total) FROM {schema}.@Pemptied e), 0);
    -- The leases, done rows and retry log are truncated only when they have a page: a TRUNCATE gives a
    -- table, its index and its TOAST table new files, each a new pg_class row version (which a held
    -- horizon keeps, and every session's lookups of the table then walk) and a cache invalidation in
    -- every session; at most once those three stay empty. Under the lock nothing can write into them,
    -- and a table of no page holds no row, live or dead.
    IF v_k = 0 THEN
        v_total := v_total + (SELECT coalesce(sum(t.n), 0) FROM {schema}.@Pq0 t);
        TRUNCATE {schema}.@Ppos0, {schema}.@Pq0, {schema}.@Pemptied0;
        INSERT INTO {schema}.@Pemptied0 VALUES (v_total);
        IF pg_relation_size('{schema}.@Pl0') > 0 OR pg_relation_size('{schema}.@Pd0') > 0 THEN
            TRUNCATE {schema}.@Pl0, {schema}.@Pd0;
        END IF;
        IF pg_relation_size('{schema}.@Pr0') > 0 THEN
            TRUNCATE {schema}.@Pr0;
        END IF;
    ELSIF v_k = 1 THEN
        v_total := v_total + (SELECT coalesce(sum(t.n), 0) FROM {schema}.@Pq1 t);
        TRUNCATE {schema}.@Ppos1, {schema}.@Pq1, {schema}.@Pemptied1;
        INSERT INTO {schema}.@Pemptied1 VALUES (v_total);
        IF pg_relation_size('{schema}.@Pl1') > 0 OR pg_relation_size('{schema}.@Pd1') > 0 THEN
            TRUNCATE {schema}.@Pl1, {schema}.@Pd1;
        END IF;
        IF pg_relation_size('{schema}.@Pr1') > 0 THEN
            TRUNCATE {schema}.@Pr1;
        END IF;
    ELSIF v_k = 2 THEN
        v_total := v_total + (SELECT coalesce(sum(t.n), 0) FROM {schema}.@Pq2 t);
        TRUNCATE {schema}.@Ppos2, {schema}.@Pq2, {schema}.@Pemptied2;
        INSERT INTO {schema}.@Pemptied2 VALUES (v_total);
        IF pg_relation_size('{schema}.@Pl2') > 0 OR pg_relation_size('{schema}.@Pd2') > 0 THEN
            TRUNCATE {schema}.@Pl2, {schema}.@Pd2;
        END IF;
        IF pg_relation_size('{schema}.@Pr2') > 0 THEN
            TRUNCATE {schema}.@Pr2;
        END IF;
    ELSE
        v_total := v_total + (SELECT coalesce(sum(t.n), 0) FROM {schema}.@Pq3 t);
        TRUNCATE {schema}.@Ppos3, {schema}.@Pq3, {schema}.@Pemptied3;
        INSERT INTO {schema}.@Pemptied3 VALUES (v_total);
        IF pg_relation_size('{schema}.@Pl3') > 0 OR pg_relation_size('{schema}.@Pd3') > 0 THEN
            TRUNCATE {schema}.@Pl3, {schema}.@Pd3;
        END IF;
        IF pg_relation_size('{schema}.@Pr3') > 0 THEN
            TRUNCATE {schema}.@Pr3;
        END IF;
    END IF;
    RETURN true;
EXCEPTION WHEN lock_not_available THEN
    RETURN false;
END
$b$
@;
-- Label the segment of generation p_gen with it, after @Protate emptied it (and committed).
CREATE FUNCTION {schema}.@Plabel(p_gen bigint) RETURNS void LANGUAGE plpgsql AS $b$
BEGIN
    PERFORM pg_advisory_xact_lock(@K3, 1);
    IF {schema}.@Pseg_gen((p_gen % 4)::integer) < p_gen THEN
        PERFORM setval(format('{schema}.%I', '@Pgen' || (p_gen % 4)), p_gen);
    END IF;
END
$b$
@;
-- Whether the ring's expired messages are dropped (on_expiry 'drop') rather than failed.
CREATE FUNCTION {schema}.@Pdrops() RETURNS boolean LANGUAGE sql AS $b$
    SELECT coalesce((SELECT q.on_expiry = 'drop' FROM {schema}.queues q WHERE q.queue_id = coalesce(
        (SELECT g.queue_id FROM {schema}.ring_groups g WHERE g.gid = @Q), @Q)), false)
$b$
@;
-- Record expired messages of rows p_rows, each from its place p_from on (@Ptake passed them): copied
-- with their payload to ring_failed, last_error 'expired', unless the ring's on_expiry is 'drop'.
CREATE FUNCTION {schema}.@Pexpire(p_rows bigint[], p_from integer[]) RETURNS void LANGUAGE plpgsql AS $b$
BEGIN
    IF {schema}.@Pdrops() THEN
        RETURN;
    END IF;
    INSERT INTO {schema}.ring_failed (queue_id, id, attempts, enqueued_at, last_error, payload)
    SELECT @Q, (t.r << 16) | (p.o - 1), 0, t.enqueued_at, 'expired', p.p
    FROM unnest(p_rows, p_from) u(r, f) JOIN {schema}.@Pq t ON t.r = u.r
    CROSS JOIN LATERAL unnest(t.payloads) WITH ORDINALITY p(p, o)
    WHERE p.o > u.f
    ON CONFLICT DO NOTHING;
END
$b$
@;
-- Pop up to p_n messages in the caller's transaction: at least once (p_lease: one lease row until
-- now + p_vt), or at most once (exactly once in the caller's transaction). Messages due again first
-- (@Pagain), then the lanes'. Lanes with a row to take are locked lowest position first (try-locks:
-- concurrent pops take different lanes), up to the messages still wanted; p_wait: when others hold every such lane, wait for the
-- lowest one (at most the lock_timeout, 1 s) and read the lanes again; when it takes nothing while
-- another transaction holds a lane with rows (after that wait, or when the lanes it locked turned out
-- emptied), it fails with lock_not_available and the client pops again in a new transaction, so that a
-- pop answers nothing only when no row is left that another pop is not taking. The positions are read again after the locks, in a
-- statement of their own: a statement that locked a lane and read its position would read it as it was
-- before a pop that released the lane committed. The rows of the held lanes are then taken in row
-- order, each lane's contiguously (a lane's next row not written yet stops the lane: a push in progress
-- or a gap), up to p_n messages, possibly ending inside a row, and each moved lane's new position logged.
-- Every statement names one segment table (a branch a segment): a statement naming all four opens and
-- locks all four on every run.
CREATE FUNCTION {schema}.@Ptake(p_n integer, p_wait boolean, p_lease boolean, p_vt double precision,
    p_consumer text)
RETURNS TABLE (r_id bigint, r_attempts integer, r_deliveries integer, r_enqueued_at timestamptz,
               r_lease_until timestamptz, r_payload bytea)
LANGUAGE plpgsql SET lock_timeout = '1s' AS $b$
DECLARE
    v_last bigint := pg_sequence_last_value('{schema}.@Prows');
    v_hint bigint := pg_sequence_last_value('{schema}.@Pretrygen');
    v_until timestamptz := CASE WHEN p_lease THEN now() + make_interval(secs => p_vt) END;
    v_got integer;
    v_starts bigint[];
    v_ends bigint[];
    v_all bigint[];
    v_order integer[];
    v_locked integer[] := ARRAY[]::integer[];
    v_at bigint[];
    v_lo bigint;
    v_left integer := p_n;
    v_next bigint[];
    v_first_at bigint[];
    v_rows bigint[] := ARRAY[]::bigint[];
    v_from integer[] := ARRAY[]::integer[];
    v_to integer[] := ARRAY[]::integer[];
    v_n integer[] := ARRAY[]::integer[];
    v_moved integer[] := ARRAY[]::integer[];
    v_newat bigint[] := ARRAY[]::bigint[];
    v_pl bytea[];
    v_ts timestamptz;
    rec record;
    v_lane integer;
    v_first integer;
    v_take integer;
    v_k integer;
    v_gen bigint;
    v_cur refcursor;
    v_busy integer;
@E    v_took boolean[] := array_fill(false, ARRAY[@L]);
@E    v_skip bigint[] := array_fill(NULL::bigint, ARRAY[@L]);
@E    v_xr bigint[] := ARRAY[]::bigint[];
@E    v_xfrom integer[] := ARRAY[]::integer[];
@E    v_xlanes integer[];
@E    v_xat bigint[];
@O    v_hold smallint[];
@O    v_again integer[];
@O    v_ktook boolean[] := array_fill(false, ARRAY[@L]);
@O    v_pass bigint[] := array_fill(NULL::bigint, ARRAY[@L]);
@O    v_plans integer[];
@O    v_pat bigint[];
BEGIN
    IF v_last IS NULL THEN  -- nothing pushed yet
        RETURN;
    END IF;
    -- Messages to deliver again first (@Pagain), when some may be in the segments live now: retry rows
    -- are written only in a message's own segment, and pretrygen is the newest generation any ready one
    -- was written in (raised before it commits, so never behind a committed row). On a ring ordered
    -- per key, a lane's own ones, below, once the pop holds the lane.
    IF v_hint IS NOT NULL AND v_hint >= v_last / @S - 3
@O      AND false
    THEN
        RETURN QUERY SELECT * FROM {schema}.@Pagain(p_n, p_lease, v_until, p_consumer
@O          , NULL
            );
        GET DIAGNOSTICS v_got = ROW_COUNT;
        v_left := p_n - v_got;
        IF v_left <= 0 THEN
            RETURN;
        END IF;
    END IF;
    -- Round 2 only after a wait for a lane (p_wait), when the first round could lock none: the lanes
    -- read again, as the one waited for may have been emptied by its holder and others freed meanwhile.
    FOR v_round IN 1 .. 2 LOOP
        v_all := {schema}.@Planes(NULL);
        -- Per key: only the free lanes (@Pholds), those with messages due again too, which come first.
@O      v_hold := {schema}.@Pholds();
        SELECT array_agg((u.o - 1)::integer ORDER BY u.at
@O          * (2 - v_hold[u.o])
            ) INTO v_order FROM unnest(v_all) WITH ORDINALITY u(at, o)
        WHERE (u.at >> 16) <= v_last
@O          AND v_hold[u.o] = 0 OR v_hold[u.o] = 2
        ;
        IF v_order IS NULL THEN  -- every lane past the last row issued
            RETURN;
        END IF;
        v_busy := NULL;
        FOREACH v_lane IN ARRAY v_order LOOP
            IF pg_try_advisory_xact_lock(@K2, v_lane) THEN
                v_locked := v_locked || v_lane;
                EXIT WHEN cardinality(v_locked) >= v_left;
            ELSIF v_busy IS NULL THEN
                v_busy := v_lane;  -- held by another transaction
            END IF;
        END LOOP;
        IF cardinality(v_locked) > 0 OR NOT p_wait THEN
            EXIT;
        END IF;
        IF v_round = 2 THEN
            -- Held again after the wait: the client pops again in a new transaction (which waits holding
            -- no lane) rather than answer that nothing is ready, unless messages due again were taken.
            IF v_left = p_n THEN
                RAISE EXCEPTION 'every lane of a ring with rows to take is held by another transaction'
                    USING ERRCODE = 'lock_not_available';
            END IF;
            RETURN;
        END IF;
        -- Every lane with rows to take is held by other pops: wait for the lowest one (at most the
        -- lock_timeout, which fails the pop; the client pops again).
        PERFORM pg_advisory_xact_lock(@K2, v_order[1]);
        v_last := pg_sequence_last_value('{schema}.@Prows');
    END LOOP;
    IF cardinality(v_locked) = 0 THEN
        RETURN;
    END IF;
    -- Per key: the holds again, read after the locks (a pop that held a lane committed its lease before
    -- this one had the lane), and the locked lanes' messages due again taken first, in id order.
@O  v_hold := {schema}.@Pholds();
@O  v_locked := ARRAY(SELECT l FROM unnest(v_locked) l WHERE v_hold[l + 1] <> 1);
@O  IF cardinality(v_locked) = 0 THEN
@O      RETURN;
@O  END IF;
@O  v_again := ARRAY(SELECT l FROM unnest(v_locked) l WHERE v_hold[l + 1] = 2);
@O  IF cardinality(v_again) > 0 THEN
@O      RETURN QUERY SELECT * FROM {schema}.@Pagain(v_left, p_lease, v_until, p_consumer, v_again);
@O      GET DIAGNOSTICS v_got = ROW_COUNT;
@O      v_left := v_left - v_got;
@O      IF v_left <= 0 THEN
@O          RETURN;
@O      END IF;
@O  END IF;
    v_at := {schema}.@Planes(v_locked);
    v_next := array_fill(NULL::bigint, ARRAY[@L]);
    v_first_at := array_fill(NULL::bigint, ARRAY[@L]);
    FOR i IN 1 .. cardinality(v_locked) LOOP
        v_next[v_locked[i] + 1] := v_at[i] >> 16;
        v_first_at[v_locked[i] + 1] := v_at[i];
    END LOOP;
    SELECT min(x >> 16) INTO v_lo FROM unnest(v_at) x;
    v_gen := v_lo / @S;
    FOR part IN 1 .. 2 LOOP
        v_k := (v_gen % 4)::integer;
        IF v_k = 0 THEN
            OPEN v_cur FOR SELECT t.r, t.n
@E                , t.expires_at
                FROM {schema}.@Pq0 t WHERE t.r >= v_lo AND t.r < (v_gen + 1) * @S AND (t.r % @L)::integer = ANY (v_locked) ORDER BY t.r;
        ELSIF v_k = 1 THEN
            OPEN v_cur FOR SELECT t.r, t.n
@E                , t.expires_at
                FROM {schema}.@Pq1 t WHERE t.r >= v_lo AND t.r < (v_gen + 1) * @S AND (t.r % @L)::integer = ANY (v_locked) ORDER BY t.r;
        ELSIF v_k = 2 THEN
            OPEN v_cur FOR SELECT t.r, t.n
@E                , t.expires_at
                FROM {schema}.@Pq2 t WHERE t.r >= v_lo AND t.r < (v_gen + 1) * @S AND (t.r % @L)::integer = ANY (v_locked) ORDER BY t.r;
        ELSE
            OPEN v_cur FOR SELECT t.r, t.n
@E                , t.expires_at
                FROM {schema}.@Pq3 t WHERE t.r >= v_lo AND t.r < (v_gen + 1) * @S AND (t.r % @L)::integer = ANY (v_locked) ORDER BY t.r;
        END IF;
        LOOP
            FETCH v_cur INTO rec;
            EXIT WHEN NOT FOUND;
            v_lane := (rec.r % @L)::integer;
            CONTINUE WHEN v_next[v_lane + 1] IS NULL OR rec.r < v_next[v_lane + 1];
            IF rec.r > v_next[v_lane + 1] THEN  -- a row of this lane not written yet: the lane stops
                v_next[v_lane + 1] := NULL;
                CONTINUE;
            END IF;
            v_first := CASE WHEN (v_first_at[v_lane + 1] >> 16) = rec.r
                            THEN (v_first_at[v_lane + 1] & 65535)::integer ELSE 0 END;
@O            IF rec.n = 0 THEN  -- a lane's empty row of a push ordered per key: passed
@O                v_pass[v_lane + 1] := (rec.r + @L) << 16;
@O                v_next[v_lane + 1] := rec.r + @L;
@O                CONTINUE;
@O            END IF;
@E            IF rec.expires_at <= now() THEN
@E                -- Expired (a push with a ttl): never delivered. Passed only at the head of its lane in
@E                -- this pop (nothing taken from the lane yet), so that no lease range holds it; after a
@E                -- row taken the lane stops here, and a later pop passes it.
@E                IF v_took[v_lane + 1] THEN
@E                    v_next[v_lane + 1] := NULL;
@E                    CONTINUE;
@E                END IF;
@E                v_xr := v_xr || rec.r;
@E                v_xfrom := v_xfrom || v_first;
@E                v_next[v_lane + 1] := rec.r + @L;
@E                v_first_at[v_lane + 1] := (rec.r + @L) << 16;
@E                v_skip[v_lane + 1] := (rec.r + @L) << 16;
@E                CONTINUE;
@E            END IF;
@E            v_took[v_lane + 1] := true;
            v_take := least(rec.n - v_first, v_left);
@O            v_ktook[v_lane + 1] := true;
            v_rows := v_rows || rec.r;
            v_from := v_from || v_first;
            v_to := v_to || (v_first + v_take);
            v_n := v_n || rec.n;
            v_left := v_left - v_take;
            v_next[v_lane + 1] := rec.r + @L;
            EXIT WHEN v_left = 0;
        END LOOP;
        CLOSE v_cur;
        EXIT WHEN v_left = 0 OR NOT EXISTS (SELECT 1 FROM unnest(v_locked) l WHERE v_next[l + 1] IS NOT NULL);
        v_gen := v_gen + 1;
        v_lo := v_gen * @S;
    END LOOP;
    -- Expired rows passed: recorded (@Pexpire), and the lanes that passed only such rows logged past
    -- them (those that took rows too are logged below). When nothing else was taken, look again for
    -- what is still wanted (v_left: messages due again may have been returned already): the lanes are
    -- past them in this transaction, and the locks held stay held.
@E    IF cardinality(v_xr) > 0 THEN
@E        PERFORM {schema}.@Pexpire(v_xr, v_xfrom);
@E        SELECT array_agg(l - 1 ORDER BY l), array_agg(v_skip[l] ORDER BY l) INTO v_xlanes, v_xat
@E        FROM generate_series(1, @L) l WHERE v_skip[l] IS NOT NULL AND NOT v_took[l];
@E        IF v_xlanes IS NOT NULL THEN
@E            PERFORM {schema}.@Plog(v_xlanes, v_xat);
@E        END IF;
@E        IF cardinality(v_rows) = 0
@E@O          AND false
@E        THEN
@E            RETURN QUERY SELECT * FROM {schema}.@Ptake(v_left, p_wait, p_lease, p_vt, p_consumer);
@E            RETURN;
@E        END IF;
@E    END IF;
    -- Per key: the lanes that only passed empty rows logged past them (no lease names them); when
    -- nothing was taken, look again as after expired rows.
@O  SELECT array_agg(l - 1 ORDER BY l), array_agg(v_pass[l] ORDER BY l) INTO v_plans, v_pat
@O  FROM generate_series(1, @L) l WHERE v_pass[l] IS NOT NULL AND NOT v_ktook[l];
@O  IF v_plans IS NOT NULL THEN
@O      PERFORM {schema}.@Plog(v_plans, v_pat);
@O  END IF;
@O  IF cardinality(v_rows) = 0 THEN
@O      IF v_plans IS NOT NULL
@O@E          OR cardinality(v_xr) > 0
@O      THEN
@O          RETURN QUERY SELECT * FROM {schema}.@Ptake(v_left, p_wait, p_lease, p_vt, p_consumer);
@O          RETURN;
@O      END IF;
@O  END IF;
    IF cardinality(v_rows) = 0 THEN
        -- The lanes locked had nothing to take after all, each past the last row issued (pops emptied
        -- them after the positions were read), while another transaction held a lane with rows: the
        -- client pops again in a new transaction, which waits for that lane, rather than answer that
        -- nothing is ready. (Not when a lane locked stops at a row not written yet: that is a push in
        -- progress or a gap, which an empty answer lets the client give up.)
        IF p_wait AND v_busy IS NOT NULL AND v_left = p_n
           AND NOT EXISTS (SELECT 1 FROM unnest(v_at) x WHERE (x >> 16) <= v_last) THEN
            RAISE EXCEPTION 'the lanes of a ring with rows to take are held by other transactions'
                USING ERRCODE = 'lock_not_available';
        END IF;
        RETURN;
    END IF;
    -- Each moved lane's new position: past its last row taken when taken to its end, else the place
    -- in it where the pop stopped.
    FOR i IN 1 .. cardinality(v_rows) LOOP
        v_lane := (v_rows[i] % @L)::integer;
        v_k := array_position(v_moved, v_lane);
        IF v_k IS NULL THEN
            v_moved := v_moved || v_lane;
            v_newat := v_newat || 0::bigint;
            v_k := cardinality(v_moved);
        END IF;
        v_newat[v_k] := CASE WHEN v_to[i] = v_n[i] THEN (v_rows[i] + @L) << 16
                             ELSE (v_rows[i] << 16) | v_to[i] END;
    END LOOP;
    -- Per key: past the empty rows a lane passed after its last row taken, and each entry naming this
    -- pop's lease, which holds the lanes until it is closed (@Pholds).
@O  FOR i IN 1 .. cardinality(v_moved) LOOP
@O      v_newat[i] := greatest(v_newat[i], v_pass[v_moved[i] + 1]);
@O  END LOOP;
@O  PERFORM {schema}.@Plog(v_moved, v_newat, CASE WHEN p_lease THEN (v_rows[1] << 16) | v_from[1] END);
@U  PERFORM {schema}.@Plog(v_moved, v_newat);
    -- At least once: one lease row, in the segment of its first message, naming each moved lane's
    -- taken range [start, end) (NULL for the lanes it did not move).
    IF p_lease THEN
        v_starts := array_fill(NULL::bigint, ARRAY[@L]);
        v_ends := array_fill(NULL::bigint, ARRAY[@L]);
        FOR i IN 1 .. cardinality(v_moved) LOOP
            v_starts[v_moved[i] + 1] := v_first_at[v_moved[i] + 1];
            v_ends[v_moved[i] + 1] := v_newat[i];
        END LOOP;
        v_lo := (v_rows[1] << 16) | v_from[1];
        v_got := 0;
        FOR i IN 1 .. cardinality(v_rows) LOOP
            v_got := v_got + v_to[i] - v_from[i];
        END LOOP;
        v_k := (v_rows[1] / @S % 4)::integer;
        IF v_k = 0 THEN
            INSERT INTO {schema}.@Pl0 VALUES (v_lo, (v_rows[cardinality(v_rows)] << 16) | (v_to[cardinality(v_to)] - 1), v_got, v_starts, v_ends, v_until, p_consumer);
        ELSIF v_k = 1 THEN
            INSERT INTO {schema}.@Pl1 VALUES (v_lo, (v_rows[cardinality(v_rows)] << 16) | (v_to[cardinality(v_to)] - 1), v_got, v_starts, v_ends, v_until, p_consumer);
        ELSIF v_k = 2 THEN
            INSERT INTO {schema}.@Pl2 VALUES (v_lo, (v_rows[cardinality(v_rows)] << 16) | (v_to[cardinality(v_to)] - 1), v_got, v_starts, v_ends, v_until, p_consumer);
        ELSE
            INSERT INTO {schema}.@Pl3 VALUES (v_lo, (v_rows[cardinality(v_rows)] << 16) | (v_to[cardinality(v_to)] - 1), v_got, v_starts, v_ends, v_until, p_consumer);
        END IF;
    END IF;
    -- The messages: each taken row's slice of payloads, in row order.
    FOR i IN 1 .. cardinality(v_rows) LOOP
        v_k := (v_rows[i] / @S % 4)::integer;
        IF v_k = 0 THEN
            SELECT t.payloads[v_from[i] + 1 : v_to[i]], t.enqueued_at INTO v_pl, v_ts FROM {schema}.@Pq0 t WHERE t.r = v_rows[i];
        ELSIF v_k = 1 THEN
            SELECT t.payloads[v_from[i] + 1 : v_to[i]], t.enqueued_at INTO v_pl, v_ts FROM {schema}.@Pq1 t WHERE t.r = v_rows[i];
        ELSIF v_k = 2 THEN
            SELECT t.payloads[v_from[i] + 1 : v_to[i]], t.enqueued_at INTO v_pl, v_ts FROM {schema}.@Pq2 t WHERE t.r = v_rows[i];
        ELSE
            SELECT t.payloads[v_from[i] + 1 : v_to[i]], t.enqueued_at INTO v_pl, v_ts FROM {schema}.@Pq3 t WHERE t.r = v_rows[i];
        END IF;
        RETURN QUERY SELECT (v_rows[i] << 16) | (v_from[i] + u.o - 1), 1, 1, v_ts, v_until, u.p FROM unnest(v_pl) WITH ORDINALITY u(p, o);
    END LOOP;
END
$b$
@;
-- Pop one message in the caller's transaction (a pop of one's path): what @Ptake(1, ...) does, usually
-- in two statements of its own. (1) Lock the lane of the lowest position whose next row is issued and
-- written, try-locking lanes in that order (positions and rows as this statement's snapshot saw them),
-- each lane's position read in the newest segment of the log only (one index scan a lane; its row is in
-- that segment or the next); when some lane has no entry there (pops are crossing into it), the same
-- with each lane's position read newest segment first. (2) Read the message at the lane's position, log
-- the lane's new position (and at least once, insert the lease row: the message's lane range, as @Ptake
-- writes it) in one statement on the segment of that message, begun after the lock: it checks there that
-- the position is still the one read (see below), or takes it from a statement of its own read after
-- the lock when it cannot (see @Ptake). It hands the pop over to @Ptake (which may wait for a held lane)
-- when messages to deliver again may be due (those come first), when no such lane could be locked, and
-- when the locked lane's row at its position is not written after all or its position moved (a pop
-- moved it meanwhile; @Ptake takes the lane again, a lock this transaction holds), or has expired
-- (@Ptake passes and records it). A pop at most once has statements without the lease row's insert.
CREATE FUNCTION {schema}.@Ptake1(p_wait boolean, p_lease boolean, p_vt double precision, p_consumer text)
RETURNS TABLE (r_id bigint, r_attempts integer, r_deliveries integer, r_enqueued_at timestamptz,
               r_lease_until timestamptz, r_payload bytea)
LANGUAGE plpgsql AS $b$
DECLARE
    v_last bigint := pg_sequence_last_value('{schema}.@Prows');
    v_until timestamptz;
    v_tail bigint[];
    v_lane integer;
    v_at bigint;
    v_r bigint;
    v_k integer;
    v_kn integer;
    v_gen bigint;
    v_check boolean;
BEGIN
    IF v_last IS NULL THEN  -- nothing pushed yet
        RETURN;
    END IF;
    -- A ring ordered per key pops one as any number (@Ptake: only free lanes, empty rows passed).
@O  RETURN QUERY SELECT * FROM {schema}.@Ptake(1, p_wait, p_lease, p_vt, p_consumer);
@O  RETURN;
    IF coalesce(pg_sequence_last_value('{schema}.@Pretrygen'), -4) < v_last / @S - 3 THEN
        -- Each lane's position in the newest segment of the log (pos_gen's), lowest first; a lane with none
        -- there (NULL, sorted first) sends the pop to the full read below. One
        -- CASE, so that a lane is try-locked only once its row is found written (the planner orders the
        -- conditions of an AND by their cost; the CASE evaluates in order), and the row is read in its own
        -- segment only, a scalar subquery (which the planner cannot turn into a hash of the whole
        -- segment). Every statement here has one plan whatever its parameters' values (no array
        -- parameter, whose length a custom plan would count), so PostgreSQL keeps a generic one.
        v_gen := coalesce(pg_sequence_last_value('{schema}.@Pposgen'), 0);
        v_kn := (v_gen % 4)::integer;
        IF v_kn = 0 THEN
            SELECT l.lane, l.at INTO v_lane, v_at FROM (
                SELECT g AS lane, (SELECT p.at FROM {schema}.@Ppos0 p WHERE p.lane = g ORDER BY p.at DESC LIMIT 1) AS at
                FROM generate_series(0, @L - 1) g ORDER BY 2 NULLS FIRST OFFSET 0) l
            WHERE CASE WHEN l.at IS NULL THEN true
                       WHEN (l.at >> 16) <= v_last AND CASE WHEN (l.at >> 16) / @S % 4 = 0
                           THEN (SELECT true FROM {schema}.@Pq0 t WHERE t.r = l.at >> 16)
                           ELSE (SELECT true FROM {schema}.@Pq1 t WHERE t.r = l.at >> 16) END
                       THEN pg_try_advisory_xact_lock(@K2, l.lane) END
            LIMIT 1;
        ELSIF v_kn = 1 THEN
            SELECT l.lane, l.at INTO v_lane, v_at FROM (
                SELECT g AS lane, (SELECT p.at FROM {schema}.@Ppos1 p WHERE p.lane = g ORDER BY p.at DESC LIMIT 1) AS at
                FROM generate_series(0, @L - 1) g ORDER BY 2 NULLS FIRST OFFSET 0) l
            WHERE CASE WHEN l.at IS NULL THEN true
                       WHEN (l.at >> 16) <= v_last AND CASE WHEN (l.at >> 16) / @S % 4 = 1
                           THEN (SELECT true FROM {schema}.@Pq1 t WHERE t.r = l.at >> 16)
                           ELSE (SELECT true FROM {schema}.@Pq2 t WHERE t.r = l.at >> 16) END
                       THEN pg_try_advisory_xact_lock(@K2, l.lane) END
            LIMIT 1;
        ELSIF v_kn = 2 THEN
            SELECT l.lane, l.at INTO v_lane, v_at FROM (
                SELECT g AS lane, (SELECT p.at FROM {schema}.@Ppos2 p WHERE p.lane = g ORDER BY p.at DESC LIMIT 1) AS at
                FROM generate_series(0, @L - 1) g ORDER BY 2 NULLS FIRST OFFSET 0) l
            WHERE CASE WHEN l.at IS NULL THEN true
                       WHEN (l.at >> 16) <= v_last AND CASE WHEN (l.at >> 16) / @S % 4 = 2
                           THEN (SELECT true FROM {schema}.@Pq2 t WHERE t.r = l.at >> 16)
                           ELSE (SELECT true FROM {schema}.@Pq3 t WHERE t.r = l.at >> 16) END
                       THEN pg_try_advisory_xact_lock(@K2, l.lane) END
            LIMIT 1;
        ELSE
            SELECT l.lane, l.at INTO v_lane, v_at FROM (
                SELECT g AS lane, (SELECT p.at FROM {schema}.@Ppos3 p WHERE p.lane = g ORDER BY p.at DESC LIMIT 1) AS at
                FROM generate_series(0, @L - 1) g ORDER BY 2 NULLS FIRST OFFSET 0) l
            WHERE CASE WHEN l.at IS NULL THEN true
                       WHEN (l.at >> 16) <= v_last AND CASE WHEN (l.at >> 16) / @S % 4 = 3
                           THEN (SELECT true FROM {schema}.@Pq3 t WHERE t.r = l.at >> 16)
                           ELSE (SELECT true FROM {schema}.@Pq0 t WHERE t.r = l.at >> 16) END
                       THEN pg_try_advisory_xact_lock(@K2, l.lane) END
            LIMIT 1;
        END IF;
        IF v_lane IS NOT NULL AND v_at IS NULL THEN
            -- Some lane has no entry in the newest segment of the log (pops are crossing into it):
            -- its position is in an older one, and each lane's is read newest segment first.
            v_lane := NULL;
            v_gen := NULL;
            IF v_kn = 0 THEN
                SELECT l.lane INTO v_lane FROM (
                    SELECT g AS lane, coalesce((SELECT max(p.at) FROM {schema}.@Ppos0 p WHERE p.lane = g), (SELECT max(p.at) FROM {schema}.@Ppos3 p WHERE p.lane = g), (SELECT max(p.at) FROM {schema}.@Ppos2 p WHERE p.lane = g), (SELECT max(p.at) FROM {schema}.@Ppos1 p WHERE p.lane = g)) AS at
                    FROM generate_series(0, @L - 1) g ORDER BY 2 OFFSET 0) l
                WHERE CASE WHEN (l.at >> 16) <= v_last AND CASE ((l.at >> 16) / @S % 4)
                               WHEN 0 THEN (SELECT true FROM {schema}.@Pq0 t WHERE t.r = l.at >> 16)
                               WHEN 1 THEN (SELECT true FROM {schema}.@Pq1 t WHERE t.r = l.at >> 16)
                               WHEN 2 THEN (SELECT true FROM {schema}.@Pq2 t WHERE t.r = l.at >> 16)
                               ELSE (SELECT true FROM {schema}.@Pq3 t WHERE t.r = l.at >> 16) END
                           THEN pg_try_advisory_xact_lock(@K2, l.lane) END
                LIMIT 1;
            ELSIF v_kn = 1 THEN
                SELECT l.lane INTO v_lane FROM (
                    SELECT g AS lane, coalesce((SELECT max(p.at) FROM {schema}.@Ppos1 p WHERE p.lane = g), (SELECT max(p.at) FROM {schema}.@Ppos0 p WHERE p.lane = g), (SELECT max(p.at) FROM {schema}.@Ppos3 p WHERE p.lane = g), (SELECT max(p.at) FROM {schema}.@Ppos2 p WHERE p.lane = g)) AS at
                    FROM generate_series(0, @L - 1) g ORDER BY 2 OFFSET 0) l
                WHERE CASE WHEN (l.at >> 16) <= v_last AND CASE ((l.at >> 16) / @S % 4)
                               WHEN 0 THEN (SELECT true FROM {schema}.@Pq0 t WHERE t.r = l.at >> 16)
                               WHEN 1 THEN (SELECT true FROM {schema}.@Pq1 t WHERE t.r = l.at >> 16)
                               WHEN 2 THEN (SELECT true FROM {schema}.@Pq2 t WHERE t.r = l.at >> 16)
                               ELSE (SELECT true FROM {schema}.@Pq3 t WHERE t.r = l.at >> 16) END
                           THEN pg_try_advisory_xact_lock(@K2, l.lane) END
                LIMIT 1;
            ELSIF v_kn = 2 THEN
                SELECT l.lane INTO v_lane FROM (
                    SELECT g AS lane, coalesce((SELECT max(p.at) FROM {schema}.@Ppos2 p WHERE p.lane = g), (SELECT max(p.at) FROM {schema}.@Ppos1 p WHERE p.lane = g), (SELECT max(p.at) FROM {schema}.@Ppos0 p WHERE p.lane = g), (SELECT max(p.at) FROM {schema}.@Ppos3 p WHERE p.lane = g)) AS at
                    FROM generate_series(0, @L - 1) g ORDER BY 2 OFFSET 0) l
                WHERE CASE WHEN (l.at >> 16) <= v_last AND CASE ((l.at >> 16) / @S % 4)
                               WHEN 0 THEN (SELECT true FROM {schema}.@Pq0 t WHERE t.r = l.at >> 16)
                               WHEN 1 THEN (SELECT true FROM {schema}.@Pq1 t WHERE t.r = l.at >> 16)
                               WHEN 2 THEN (SELECT true FROM {schema}.@Pq2 t WHERE t.r = l.at >> 16)
                               ELSE (SELECT true FROM {schema}.@Pq3 t WHERE t.r = l.at >> 16) END
                           THEN pg_try_advisory_xact_lock(@K2, l.lane) END
                LIMIT 1;
            ELSE
                SELECT l.lane INTO v_lane FROM (
                    SELECT g AS lane, coalesce((SELECT max(p.at) FROM {schema}.@Ppos3 p WHERE p.lane = g), (SELECT max(p.at) FROM {schema}.@Ppos2 p WHERE p.lane = g), (SELECT max(p.at) FROM {schema}.@Ppos1 p WHERE p.lane = g), (SELECT max(p.at) FROM {schema}.@Ppos0 p WHERE p.lane = g)) AS at
                    FROM generate_series(0, @L - 1) g ORDER BY 2 OFFSET 0) l
                WHERE CASE WHEN (l.at >> 16) <= v_last AND CASE ((l.at >> 16) / @S % 4)
                               WHEN 0 THEN (SELECT true FROM {schema}.@Pq0 t WHERE t.r = l.at >> 16)
                               WHEN 1 THEN (SELECT true FROM {schema}.@Pq1 t WHERE t.r = l.at >> 16)
                               WHEN 2 THEN (SELECT true FROM {schema}.@Pq2 t WHERE t.r = l.at >> 16)
                               ELSE (SELECT true FROM {schema}.@Pq3 t WHERE t.r = l.at >> 16) END
                           THEN pg_try_advisory_xact_lock(@K2, l.lane) END
                LIMIT 1;
            END IF;
        END IF;
    END IF;
    IF v_lane IS NOT NULL THEN
        -- The lane's position again, after the lock. When the first statement read it in the newest
        -- segment of the log, its row is in that segment, and no pop has logged in a newer one since
        -- (pos_gen the same, read after the lock: a pop raises it before it commits, and the lane's
        -- last pop committed before this one had the lock), the lane's newest entry can only be in that
        -- segment: the third statement checks it there (v_check: its max still the position read) and
        -- takes nothing otherwise (then @Ptake). Else it is read here, in statements of its own (see
        -- @Ptake): newest segment of the log first, an older one only when the lane has no entry there
        -- (each a statement of its own, so that the usual read starts one index scan, not four).
        v_check := v_gen IS NOT NULL AND ((v_at >> 16) / @S % 4)::integer = v_kn
            AND v_gen = coalesce(pg_sequence_last_value('{schema}.@Pposgen'), 0);
        IF NOT v_check THEN
            v_kn := (coalesce(pg_sequence_last_value('{schema}.@Pposgen'), 0) % 4)::integer;
            FOR i IN 0 .. 3 LOOP
                v_k := (v_kn + 4 - i) % 4;
                IF v_k = 0 THEN
                    v_at := (SELECT max(p.at) FROM {schema}.@Ppos0 p WHERE p.lane = v_lane);
                ELSIF v_k = 1 THEN
                    v_at := (SELECT max(p.at) FROM {schema}.@Ppos1 p WHERE p.lane = v_lane);
                ELSIF v_k = 2 THEN
                    v_at := (SELECT max(p.at) FROM {schema}.@Ppos2 p WHERE p.lane = v_lane);
                ELSE
                    v_at := (SELECT max(p.at) FROM {schema}.@Ppos3 p WHERE p.lane = v_lane);
                END IF;
                EXIT WHEN v_at IS NOT NULL;
            END LOOP;
        END IF;
        v_r := v_at >> 16;
        v_k := (v_r / @S % 4)::integer;
        v_until := CASE WHEN p_lease THEN now() + make_interval(secs => p_vt) END;
        v_tail := array_fill(NULL::bigint, ARRAY[@L - 1 - v_lane]);
        IF v_k = 0 AND p_lease THEN
            RETURN QUERY
            WITH t AS (
                SELECT t.n, t.enqueued_at, t.payloads[(v_at & 65535)::integer + 1] AS p,
                       CASE WHEN (v_at & 65535) + 1 = t.n THEN (v_r + @L) << 16 ELSE v_at + 1 END AS next
                FROM {schema}.@Pq0 t WHERE t.r = v_r
@E                  AND NOT coalesce(t.expires_at <= now(), false)
                  AND (NOT v_check OR (SELECT p.at FROM {schema}.@Ppos0 p WHERE p.lane = v_lane ORDER BY p.at DESC LIMIT 1) = v_at)
                ),
            w AS (INSERT INTO {schema}.@Ppos0 SELECT v_lane, t.next FROM t),
            e AS (INSERT INTO {schema}.@Pl0 SELECT v_at, v_at, 1, array_fill(NULL::bigint, ARRAY[v_lane]) || v_at || v_tail,
                      array_fill(NULL::bigint, ARRAY[v_lane]) || t.next || v_tail, v_until, p_consumer FROM t)
            SELECT v_at, 1, 1, t.enqueued_at, v_until, t.p FROM t;
        ELSIF v_k = 0 THEN
            RETURN QUERY
            WITH t AS (
                SELECT t.n, t.enqueued_at, t.payloads[(v_at & 65535)::integer + 1] AS p,
                       CASE WHEN (v_at & 65535) + 1 = t.n THEN (v_r + @L) << 16 ELSE v_at + 1 END AS next
                FROM {schema}.@Pq0 t WHERE t.r = v_r
@E                  AND NOT coalesce(t.expires_at <= now(), false)
                  AND (NOT v_check OR (SELECT p.at FROM {schema}.@Ppos0 p WHERE p.lane = v_lane ORDER BY p.at DESC LIMIT 1) = v_at)
                ),
            w AS (INSERT INTO {schema}.@Ppos0 SELECT v_lane, t.next FROM t)
            SELECT v_at, 1, 1, t.enqueued_at, v_until, t.p FROM t;
        ELSIF v_k = 1 AND p_lease THEN
            RETURN QUERY
            WITH t AS (
                SELECT t.n, t.enqueued_at, t.payloads[(v_at & 65535)::integer + 1] AS p,
                       CASE WHEN (v_at & 65535) + 1 = t.n THEN (v_r + @L) << 16 ELSE v_at + 1 END AS next
                FROM {schema}.@Pq1 t WHERE t.r = v_r
@E                  AND NOT coalesce(t.expires_at <= now(), false)
                  AND (NOT v_check OR (SELECT p.at FROM {schema}.@Ppos1 p WHERE p.lane = v_lane ORDER BY p.at DESC LIMIT 1) = v_at)
                ),
            w AS (INSERT INTO {schema}.@Ppos1 SELECT v_lane, t.next FROM t),
            e AS (INSERT INTO {schema}.@Pl1 SELECT v_at, v_at, 1, array_fill(NULL::bigint, ARRAY[v_lane]) || v_at || v_tail,
                      array_fill(NULL::bigint, ARRAY[v_lane]) || t.next || v_tail, v_until, p_consumer FROM t)
            SELECT v_at, 1, 1, t.enqueued_at, v_until, t.p FROM t;
        ELSIF v_k = 1 THEN
            RETURN QUERY
            WITH t AS (
                SELECT t.n, t.enqueued_at, t.payloads[(v_at & 65535)::integer + 1] AS p,
                       CASE WHEN (v_at & 65535) + 1 = t.n THEN (v_r + @L) << 16 ELSE v_at + 1 END AS next
                FROM {schema}.@Pq1 t WHERE t.r = v_r
@E                  AND NOT coalesce(t.expires_at <= now(), false)
                  AND (NOT v_check OR (SELECT p.at FROM {schema}.@Ppos1 p WHERE p.lane = v_lane ORDER BY p.at DESC LIMIT 1) = v_at)
                ),
            w AS (INSERT INTO {schema}.@Ppos1 SELECT v_lane, t.next FROM t)
            SELECT v_at, 1, 1, t.enqueued_at, v_until, t.p FROM t;
        ELSIF v_k = 2 AND p_lease THEN
            RETURN QUERY
            WITH t AS (
                SELECT t.n, t.enqueued_at, t.payloads[(v_at & 65535)::integer + 1] AS p,
                       CASE WHEN (v_at & 65535) + 1 = t.n THEN (v_r + @L) << 16 ELSE v_at + 1 END AS next
                FROM {schema}.@Pq2 t WHERE t.r = v_r
@E                  AND NOT coalesce(t.expires_at <= now(), false)
                  AND (NOT v_check OR (SELECT p.at FROM {schema}.@Ppos2 p WHERE p.lane = v_lane ORDER BY p.at DESC LIMIT 1) = v_at)
                ),
            w AS (INSERT INTO {schema}.@Ppos2 SELECT v_lane, t.next FROM t),
            e AS (INSERT INTO {schema}.@Pl2 SELECT v_at, v_at, 1, array_fill(NULL::bigint, ARRAY[v_lane]) || v_at || v_tail,
                      array_fill(NULL::bigint, ARRAY[v_lane]) || t.next || v_tail, v_until, p_consumer FROM t)
            SELECT v_at, 1, 1, t.enqueued_at, v_until, t.p FROM t;
        ELSIF v_k = 2 THEN
            RETURN QUERY
            WITH t AS (
                SELECT t.n, t.enqueued_at, t.payloads[(v_at & 65535)::integer + 1] AS p,
                       CASE WHEN (v_at & 65535) + 1 = t.n THEN (v_r + @L) << 16 ELSE v_at + 1 END AS next
                FROM {schema}.@Pq2 t WHERE t.r = v_r
@E                  AND NOT coalesce(t.expires_at <= now(), false)
                  AND (NOT v_check OR (SELECT p.at FROM {schema}.@Ppos2 p WHERE p.lane = v_lane ORDER BY p.at DESC LIMIT 1) = v_at)
                ),
            w AS (INSERT INTO {schema}.@Ppos2 SELECT v_lane, t.next FROM t)
            SELECT v_at, 1, 1, t.enqueued_at, v_until, t.p FROM t;
        ELSIF v_k = 3 AND p_lease THEN
            RETURN QUERY
            WITH t AS (
                SELECT t.n, t.enqueued_at, t.payloads[(v_at & 65535)::integer + 1] AS p,
                       CASE WHEN (v_at & 65535) + 1 = t.n THEN (v_r + @L) << 16 ELSE v_at + 1 END AS next
                FROM {schema}.@Pq3 t WHERE t.r = v_r
@E                  AND NOT coalesce(t.expires_at <= now(), false)
                  AND (NOT v_check OR (SELECT p.at FROM {schema}.@Ppos3 p WHERE p.lane = v_lane ORDER BY p.at DESC LIMIT 1) = v_at)
                ),
            w AS (INSERT INTO {schema}.@Ppos3 SELECT v_lane, t.next FROM t),
            e AS (INSERT INTO {schema}.@Pl3 SELECT v_at, v_at, 1, array_fill(NULL::bigint, ARRAY[v_lane]) || v_at || v_tail,
                      array_fill(NULL::bigint, ARRAY[v_lane]) || t.next || v_tail, v_until, p_consumer FROM t)
            SELECT v_at, 1, 1, t.enqueued_at, v_until, t.p FROM t;
        ELSIF v_k = 3 THEN
            RETURN QUERY
            WITH t AS (
                SELECT t.n, t.enqueued_at, t.payloads[(v_at & 65535)::integer + 1] AS p,
                       CASE WHEN (v_at & 65535) + 1 = t.n THEN (v_r + @L) << 16 ELSE v_at + 1 END AS next
                FROM {schema}.@Pq3 t WHERE t.r = v_r
@E                  AND NOT coalesce(t.expires_at <= now(), false)
                  AND (NOT v_check OR (SELECT p.at FROM {schema}.@Ppos3 p WHERE p.lane = v_lane ORDER BY p.at DESC LIMIT 1) = v_at)
                ),
            w AS (INSERT INTO {schema}.@Ppos3 SELECT v_lane, t.next FROM t)
            SELECT v_at, 1, 1, t.enqueued_at, v_until, t.p FROM t;
        END IF;
        IF FOUND THEN
            -- pos_gen, as @Plog raises it: under a lock, before this pop commits
            IF v_r / @S > coalesce(pg_sequence_last_value('{schema}.@Pposgen'), 0) THEN
                PERFORM pg_advisory_xact_lock(@K3, 0);
                IF v_r / @S > coalesce(pg_sequence_last_value('{schema}.@Pposgen'), 0) THEN
                    PERFORM setval('{schema}.@Pposgen', v_r / @S);
                END IF;
            END IF;
            RETURN;
        END IF;
    END IF;
    RETURN QUERY SELECT * FROM {schema}.@Ptake(1, p_wait, p_lease, p_vt, p_consumer);
END
$b$
@;
-- Give up gaps: rows a lane waits for that were issued (at most p_last) but never written, once every
-- transaction older than p_xmax has ended. A push takes its transaction id before its row number, so
-- such a row's push has ended without writing it, and no row can come later. Lanes other pops hold are
-- left for another call. Returns what to pass next time: the row sequence's position, then this
-- call's own transaction id, taken after it (every transaction id assigned before is lower, so every row
-- issued by then belongs to a lower one; a snapshot's xmax would not do: it is one past the newest
-- transaction that ENDED, and a push still running may hold a higher id), and how many rows were given up.
CREATE FUNCTION {schema}.@Pgaps(p_xmax bigint, p_last bigint,
    OUT r_xmax bigint, OUT r_last bigint, OUT r_skipped integer) LANGUAGE plpgsql AS $b$
DECLARE
    v_at bigint[];
    v_lanes integer[] := ARRAY[]::integer[];
    v_newat bigint[] := ARRAY[]::bigint[];
    v_r bigint;
    v_found boolean;
    v_lane integer;
BEGIN
    r_skipped := 0;
    IF p_xmax IS NOT NULL AND pg_snapshot_xmin(pg_current_snapshot())::text::bigint >= p_xmax THEN
        -- Only the lanes whose position (read once, unlocked) is at the start of a row issued by the
        -- last look: a position only rises, so a lane past that row has no gap this proof covers.
        FOR v_lane IN SELECT (u.o - 1)::integer FROM unnest({schema}.@Planes(NULL)) WITH ORDINALITY u(at, o)
                      WHERE (u.at & 65535) = 0 AND (u.at >> 16) <= p_last ORDER BY u.o LOOP
            CONTINUE WHEN NOT pg_try_advisory_xact_lock(@K2, v_lane);
            v_at := {schema}.@Planes(ARRAY[v_lane]);
            v_r := v_at[1] >> 16;
            CONTINUE WHEN (v_at[1] & 65535) <> 0;
            LOOP
                EXIT WHEN v_r > p_last;
                SELECT true INTO v_found FROM {schema}.@Pq t WHERE t.r = v_r;
                EXIT WHEN v_found;
                r_skipped := r_skipped + 1;
                v_r := v_r + @L;
            END LOOP;
            IF v_r <> v_at[1] >> 16 THEN
                v_lanes := v_lanes || v_lane;
                v_newat := v_newat || (v_r << 16);
            END IF;
        END LOOP;
        IF cardinality(v_lanes) > 0 THEN
@U            PERFORM {schema}.@Plog(v_lanes, v_newat);
@O            -- Per key: each lane keeps the lease its newest entry names (a gap passed holds nothing).
@O            FOR i IN 1 .. cardinality(v_lanes) LOOP
@O                PERFORM {schema}.@Plog(ARRAY[v_lanes[i]], ARRAY[v_newat[i]],
@O                    (SELECT p.lo FROM {schema}.@Ppos p WHERE p.lane = v_lanes[i] ORDER BY p.at DESC LIMIT 1));
@O            END LOOP;
        END IF;
    END IF;
    r_last := coalesce(pg_sequence_last_value('{schema}.@Prows'), -1);
    r_xmax := pg_current_xact_id()::text::bigint;
END
$b$
@;
-- Up to p_n ready messages in the order a pop takes them (those due again first, then the lanes'), by
-- id, taking nothing: each with its attempts and deliveries so far (0 and 0 for a lane's message, never
-- delivered; a retry row's for a message due again), as the slots layout and the table design show
-- them. A message past its time to live is not ready (a pop that reaches it fails or drops it), and a
-- lease that ran out is in flight until reclaimed, as on the other designs; @Pready counts it. On a ring
-- ordered per key, only the messages of the lanes a pop may take now (@Pblocked).
-- Its cost is that of the p_n messages, not of the ring's: the ids first, then the payloads of those
-- alone. The lanes' messages: the first p_n rows by r that hold a message past their lane's position
-- (so they hold the first p_n such messages by id; a keyed push's empty rows hold none), an index scan
-- of the segments in r order from the lowest position of a lane shown, which stops there and reads no
-- payload. Those due again: the retry log's, read whole as @Pholds reads it. Each row shown is then read
-- once, as the slice of its payloads from the first message shown to the last (a payload array read by
-- subscript is read whole for each subscript). Its plan is made once a session (a generic plan: one
-- made on every call cost more than the call's work).
CREATE FUNCTION {schema}.@Plook(p_n integer)
RETURNS TABLE (r_id bigint, r_attempts integer, r_deliveries integer, r_enqueued_at timestamptz, r_payload bytea)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $b$
BEGIN
    RETURN QUERY
    WITH l AS MATERIALIZED (SELECT {schema}.@Planes(NULL) AS at),
@O  kh AS MATERIALIZED (SELECT {schema}.@Pblocked((SELECT l.at FROM l)) AS held),
    f AS MATERIALIZED (
        SELECT t.r, t.n, greatest((SELECT l.at FROM l)[(t.r % @L)::integer + 1] - (t.r << 16), 0)::integer AS k0
        FROM {schema}.@Pq t
        WHERE t.r >= (SELECT min(u.at) >> 16 FROM l CROSS JOIN LATERAL unnest(l.at) WITH ORDINALITY u(at, o)
@O                    JOIN kh ON NOT kh.held[u.o]
                      )
          AND ((t.r << 16) | (t.n - 1)) >= (SELECT l.at FROM l)[(t.r % @L)::integer + 1]
@O        AND NOT (SELECT kh.held FROM kh)[(t.r % @L)::integer + 1]
@E        AND NOT coalesce(t.expires_at <= now(), false)
        ORDER BY t.r LIMIT p_n),
    a AS MATERIALIZED (
        SELECT r.id, r.attempts, r.deliveries FROM {schema}.@Pr r
@O      JOIN kh ON NOT kh.held[((r.id >> 16) % @L)::integer + 1]
        WHERE r.state = 1 AND r.due_at <= now()
          AND NOT EXISTS (SELECT 1 FROM {schema}.@Pr x WHERE x.id = r.id AND x.ver > r.ver)
          AND EXISTS (SELECT 1 FROM {schema}.@Pq t WHERE t.r = r.id >> 16
@E                    AND NOT coalesce(t.expires_at <= now(), false)
                      )
        ORDER BY r.id LIMIT p_n),
    x AS MATERIALIZED (
        SELECT * FROM (
            SELECT -1 AS again, a.id, a.attempts, a.deliveries FROM a
            UNION ALL
            SELECT 0, (f.r << 16) | g.k, 0, 0 FROM f CROSS JOIN LATERAL generate_series(f.k0, f.n - 1) g(k)) y
        ORDER BY y.again, y.id LIMIT p_n),
    p AS (
        SELECT w.r, w.lo + u.o - 1 AS k, t.enqueued_at, u.payload
        FROM (SELECT x.id >> 16 AS r, min(x.id & 65535)::integer AS lo, max(x.id & 65535)::integer AS hi
              FROM x GROUP BY 1) w
        JOIN {schema}.@Pq t ON t.r = w.r
        CROSS JOIN LATERAL unnest(t.payloads[w.lo + 1 : w.hi + 1]) WITH ORDINALITY u(payload, o))
    SELECT x.id, x.attempts, x.deliveries, p.enqueued_at, p.payload
    FROM x JOIN p ON p.r = x.id >> 16 AND p.k = (x.id & 65535)
    ORDER BY x.again, x.id;
END
$b$
@;
-- What ring_rows_peek, which the client of the release before calls, reads (ring_rows_look reads
-- @Plook): @Plook's messages without their attempts and deliveries. A ring made before @Plook has a
-- peek of its own, which ring_rows_look reads then.
CREATE FUNCTION {schema}.@Ppeek(p_n integer)
RETURNS TABLE (r_id bigint, r_enqueued_at timestamptz, r_payload bytea) LANGUAGE sql AS $b$
    SELECT k.r_id, k.r_enqueued_at, k.r_payload FROM {schema}.@Plook(p_n) k
$b$
@;
-- What an observer waits on (count_ready, readiness: a sensor, a trigger): the messages a pop could
-- take now, counted up to p_cap, and the id and deliveries so far of the one it would take first (no
-- row's id when none). A pop reclaims leases past their end first (@Preclaim, at most every
-- reclaim_every), so those with an attempt left count at once, before anything reclaimed them: the
-- messages of an open lease past its end (a first delivery, attempt 1: when p_max_attempts > 1) and
-- leased retry rows past their end with fewer than p_max_attempts attempts; one out of attempts fails
-- when reclaimed, and is not counted. A message past its time to live is not counted (a pop fails or
-- drops it). The head: pops serve messages due again first, in id order (a reclaimed lease's among
-- them, with the deliveries it had: 1 for an open lease's, a retry row's own), then the lanes'
-- (never delivered: 0), the lowest id first. stats() keeps counting a lease past its end in flight
-- until it is reclaimed, as the other designs do. One statement, so one snapshot: the lanes' positions
-- are read from the logs here, as @Pdepth reads them. Its cost is @Pdepth's lanes' pass (a scan of the
-- rows past the lanes) and a look at the leases and retry rows of the live segments. On a ring ordered
-- per key only the lanes a pop may take now count (@Pblocked, in the same snapshot), their messages due
-- again and their leases past their end included.
CREATE FUNCTION {schema}.@Pready(p_cap bigint, p_max_attempts integer,
    OUT r_ready bigint, OUT r_head_id bigint, OUT r_head_deliveries integer)
LANGUAGE sql AS $b$
    WITH l AS MATERIALIZED (
        SELECT k AS lane, greatest(
            (SELECT max(p.at) FROM {schema}.@Ppos0 p WHERE p.lane = k), (SELECT max(p.at) FROM {schema}.@Ppos1 p WHERE p.lane = k),
            (SELECT max(p.at) FROM {schema}.@Ppos2 p WHERE p.lane = k), (SELECT max(p.at) FROM {schema}.@Ppos3 p WHERE p.lane = k)) AS at
        FROM generate_series(0, @L - 1) k),
@O  kh AS MATERIALIZED (SELECT {schema}.@Pblocked(ARRAY(SELECT l.at FROM l ORDER BY l.lane)) AS held),
    w AS MATERIALIZED (
        SELECT t.n - CASE WHEN t.r = l.at >> 16 THEN (l.at & 65535) ELSE 0 END AS n,
               CASE WHEN t.r = l.at >> 16 THEN l.at ELSE t.r << 16 END AS first
        FROM l JOIN {schema}.@Pq t ON t.r % @L = l.lane AND t.r >= l.at >> 16
@O      JOIN kh ON NOT kh.held[l.lane + 1]
        WHERE true
@E        AND NOT coalesce(t.expires_at <= now(), false)
        ),
    a AS MATERIALIZED (
        SELECT r.id, r.deliveries FROM {schema}.@Pr r
@O      JOIN kh ON NOT kh.held[((r.id >> 16) % @L)::integer + 1]
        WHERE r.due_at <= now() AND (r.state = 1 OR (r.state = 2 AND r.attempts < p_max_attempts))
          AND NOT EXISTS (SELECT 1 FROM {schema}.@Pr x WHERE x.id = r.id AND x.ver > r.ver)
@E        AND NOT coalesce((SELECT t.expires_at <= now() FROM {schema}.@Pq t WHERE t.r = r.id >> 16), false)
        ),
    e AS MATERIALIZED (
        SELECT (t.r << 16) | g.k AS id
        FROM {schema}.@Pl e
        JOIN {schema}.@Pq t ON t.r BETWEEN e.lo >> 16 AND e.hi >> 16
        CROSS JOIN LATERAL generate_series(0, t.n - 1) g(k)
@O      JOIN kh ON NOT kh.held[(t.r % @L)::integer + 1]
        WHERE e.lease_until <= now() AND p_max_attempts > 1
          AND NOT EXISTS (SELECT 1 FROM {schema}.@Pd d WHERE d.lo = e.lo)
          AND ((t.r << 16) | g.k) BETWEEN e.lo AND e.hi
          AND e.starts[(t.r % @L)::integer + 1] <= ((t.r << 16) | g.k)
          AND ((t.r << 16) | g.k) < e.ends[(t.r % @L)::integer + 1]
@E        AND NOT coalesce(t.expires_at <= now(), false)
        )
    SELECT least(p_cap, (SELECT coalesce(sum(w.n), 0) FROM w WHERE w.n > 0)
                        + (SELECT count(*) FROM a) + (SELECT count(*) FROM e))::bigint,
           h.id, h.d
    FROM (SELECT 1) one
    LEFT JOIN LATERAL (
        SELECT c.id, c.d FROM (
            SELECT a.id, a.deliveries AS d, 0 AS fresh FROM a
            UNION ALL
            SELECT e.id, 1, 0 FROM e
            UNION ALL
            SELECT min(w.first), 0, 1 FROM w WHERE w.n > 0) c
        WHERE c.id IS NOT NULL
        ORDER BY c.fresh, c.id LIMIT 1) h ON true
$b$
@;
-- Write retry-log rows (id, ver, state, attempts, deliveries, due_at, consumer, last_error), each in the
-- segment of its message, and return the ids written: a row whose (id, ver) is taken already (another
-- call moved that message on first) is not written. State 0 finished, 1 ready from due_at, 2 leased until
-- due_at, 3 failed; a message's state is its row of the highest ver. When a ready row is written, the
-- retry hint (pretrygen) is raised to its generation, under a lock so that it only rises, and before
-- this transaction commits, so that a pop that sees the row sees the hint too.
CREATE FUNCTION {schema}.@Pput(p_ids bigint[], p_vers integer[], p_states integer[], p_att integer[],
    p_del integer[], p_due timestamptz[], p_consumers text[], p_errors text[])
RETURNS SETOF bigint LANGUAGE plpgsql AS $b$
DECLARE
    v_gen bigint;
BEGIN
    FOR k IN 0 .. 3 LOOP
        CONTINUE WHEN NOT EXISTS (SELECT 1 FROM unnest(p_ids) i WHERE (i >> 16) / @S % 4 = k);
        IF k = 0 THEN
            RETURN QUERY INSERT INTO {schema}.@Pr0 SELECT u.id, u.v, u.s, u.a, u.d, u.due, u.c, u.e
                FROM unnest(p_ids, p_vers, p_states, p_att, p_del, p_due, p_consumers, p_errors) u(id, v, s, a, d, due, c, e)
                WHERE (u.id >> 16) / @S % 4 = 0 ON CONFLICT DO NOTHING RETURNING id;
        ELSIF k = 1 THEN
            RETURN QUERY INSERT INTO {schema}.@Pr1 SELECT u.id, u.v, u.s, u.a, u.d, u.due, u.c, u.e
                FROM unnest(p_ids, p_vers, p_states, p_att, p_del, p_due, p_consumers, p_errors) u(id, v, s, a, d, due, c, e)
                WHERE (u.id >> 16) / @S % 4 = 1 ON CONFLICT DO NOTHING RETURNING id;
        ELSIF k = 2 THEN
            RETURN QUERY INSERT INTO {schema}.@Pr2 SELECT u.id, u.v, u.s, u.a, u.d, u.due, u.c, u.e
                FROM unnest(p_ids, p_vers, p_states, p_att, p_del, p_due, p_consumers, p_errors) u(id, v, s, a, d, due, c, e)
                WHERE (u.id >> 16) / @S % 4 = 2 ON CONFLICT DO NOTHING RETURNING id;
        ELSE
            RETURN QUERY INSERT INTO {schema}.@Pr3 SELECT u.id, u.v, u.s, u.a, u.d, u.due, u.c, u.e
                FROM unnest(p_ids, p_vers, p_states, p_att, p_del, p_due, p_consumers, p_errors) u(id, v, s, a, d, due, c, e)
                WHERE (u.id >> 16) / @S % 4 = 3 ON CONFLICT DO NOTHING RETURNING id;
        END IF;
    END LOOP;
    SELECT max((u.id >> 16) / @S) INTO v_gen FROM unnest(p_ids, p_states) u(id, s) WHERE u.s = 1;
    IF v_gen > coalesce(pg_sequence_last_value('{schema}.@Pretrygen'), -1) THEN
        PERFORM pg_advisory_xact_lock(@K3, 2);
        IF v_gen > coalesce(pg_sequence_last_value('{schema}.@Pretrygen'), -1) THEN
            PERFORM setval('{schema}.@Pretrygen', v_gen);
        END IF;
    END IF;
END
$b$
@;
-- The newest retry-log row of each message that has one.
CREATE FUNCTION {schema}.@Pnewest(p_ids bigint[])
RETURNS TABLE (r_id bigint, r_ver integer, r_state integer, r_attempts integer, r_deliveries integer,
               r_due timestamptz, r_consumer text, r_error text)
LANGUAGE sql AS $b$
    SELECT r.id, r.ver, r.state, r.attempts, r.deliveries, r.due_at, r.consumer, r.last_error
    FROM unnest(p_ids) u(id)
    CROSS JOIN LATERAL (SELECT * FROM {schema}.@Pr r WHERE r.id = u.id ORDER BY r.ver DESC LIMIT 1) r
$b$
@;
-- Up to p_n messages due again (a ready newest row), in id order, taken by a new row: leased until
-- p_until (p_lease), or finished. A pop try-locks the ring row of each message it takes (other pops
-- pass those rows over), and a row written by another call first is not taken (@Pput). On a ring
-- ordered per key only the messages of lanes p_lanes, which the pop holds (locked, and free: @Pholds).
CREATE FUNCTION {schema}.@Pagain(p_n integer, p_lease boolean, p_until timestamptz, p_consumer text
@O    , p_lanes integer[]
    )
RETURNS TABLE (r_id bigint, r_attempts integer, r_deliveries integer, r_enqueued_at timestamptz,
               r_lease_until timestamptz, r_payload bytea)
LANGUAGE plpgsql AS $b$
DECLARE
    v_ids bigint[] := ARRAY[]::bigint[];
    v_vers integer[] := ARRAY[]::integer[];
    v_att integer[] := ARRAY[]::integer[];
    v_del integer[] := ARRAY[]::integer[];
    v_row bigint := -1;
    v_ok boolean := false;
@E    v_xids bigint[] := ARRAY[]::bigint[];
@E    v_xvers integer[] := ARRAY[]::integer[];
@E    v_xatt integer[] := ARRAY[]::integer[];
@E    v_xdel integer[] := ARRAY[]::integer[];
@E    v_drop boolean;
@E    v_put bigint[];
    rec record;
BEGIN
    FOR rec IN
        SELECT r.id, r.ver, r.attempts, r.deliveries
@E             , (SELECT t.expires_at FROM {schema}.@Pq t WHERE t.r = r.id >> 16) AS expires_at
        FROM {schema}.@Pr r
        WHERE r.state = 1 AND r.due_at <= now()
@O        AND ((r.id >> 16) % @L)::integer = ANY (p_lanes)
          AND NOT EXISTS (SELECT 1 FROM {schema}.@Pr x WHERE x.id = r.id AND x.ver > r.ver)
        ORDER BY r.id
    LOOP
        IF rec.id >> 16 <> v_row THEN
            v_row := rec.id >> 16;
            v_ok := pg_try_advisory_xact_lock(@K4, hashint8(v_row));
        END IF;
        CONTINUE WHEN NOT v_ok;
@E        IF rec.expires_at <= now() THEN  -- due again after its expiry: it expires instead
@E            v_xids := v_xids || rec.id;
@E            v_xvers := v_xvers || (rec.ver + 1);
@E            v_xatt := v_xatt || rec.attempts;
@E            v_xdel := v_xdel || rec.deliveries;
@E            CONTINUE;
@E        END IF;
        v_ids := v_ids || rec.id;
        v_vers := v_vers || (rec.ver + 1);
        v_att := v_att || (rec.attempts + 1);
        v_del := v_del || (rec.deliveries + 1);
        EXIT WHEN cardinality(v_ids) >= p_n;
    END LOOP;
@E    IF cardinality(v_xids) > 0 THEN
@E        -- finished (dropped) or failed, as on_expiry says; copied to ring_failed when failed
@E        v_drop := {schema}.@Pdrops();
@E        v_put := ARRAY(SELECT {schema}.@Pput(v_xids, v_xvers,
@E            array_fill(CASE WHEN v_drop THEN 0 ELSE 3 END, ARRAY[cardinality(v_xids)]), v_xatt, v_xdel,
@E            array_fill(now(), ARRAY[cardinality(v_xids)]), array_fill(NULL::text, ARRAY[cardinality(v_xids)]),
@E            array_fill('expired'::text, ARRAY[cardinality(v_xids)])));
@E        IF NOT v_drop AND cardinality(v_put) > 0 THEN
@E            PERFORM {schema}.@Pfail(
@E                ARRAY(SELECT u.id FROM unnest(v_xids, v_xatt) u(id, a) WHERE u.id = ANY (v_put) ORDER BY u.id),
@E                ARRAY(SELECT u.a FROM unnest(v_xids, v_xatt) u(id, a) WHERE u.id = ANY (v_put) ORDER BY u.id),
@E                array_fill('expired'::text, ARRAY[cardinality(v_put)]));
@E        END IF;
@E    END IF;
    IF cardinality(v_ids) = 0 THEN
        RETURN;
    END IF;
    RETURN QUERY
    WITH w AS (
        SELECT array_agg(p.id) AS ids FROM {schema}.@Pput(v_ids, v_vers,
            array_fill(CASE WHEN p_lease THEN 2 ELSE 0 END, ARRAY[cardinality(v_ids)]), v_att, v_del,
            array_fill(coalesce(p_until, now()), ARRAY[cardinality(v_ids)]),
            array_fill(p_consumer, ARRAY[cardinality(v_ids)]), NULL::text[]) p(id)
    )
    SELECT u.id, u.a, u.d, t.enqueued_at, p_until, t.payloads[(u.id & 65535)::integer + 1]
    FROM w CROSS JOIN unnest(v_ids, v_att, v_del) u(id, a, d)
    JOIN {schema}.@Pq t ON t.r = u.id >> 16
    WHERE u.id = ANY (w.ids)
    ORDER BY u.id;
END
$b$
@;
-- The messages of leases p_los (id, lease_until, consumer), from the rows they took.
CREATE FUNCTION {schema}.@Plmsgs(p_los bigint[])
RETURNS TABLE (r_id bigint, r_until timestamptz, r_consumer text) LANGUAGE sql AS $b$
    SELECT (t.r << 16) | g.k, e.lease_until, e.consumer
    FROM {schema}.@Pl e
    JOIN {schema}.@Pq t ON t.r BETWEEN e.lo >> 16 AND e.hi >> 16
    CROSS JOIN LATERAL generate_series(0, t.n - 1) g(k)
    WHERE e.lo = ANY (p_los)
      AND ((t.r << 16) | g.k) BETWEEN e.lo AND e.hi
      AND e.starts[(t.r % @L)::integer + 1] <= ((t.r << 16) | g.k)
      AND ((t.r << 16) | g.k) < e.ends[(t.r % @L)::integer + 1]
$b$
@;
-- Close leases p_los that are open (a done row each, in the lease's segment) and give each of their
-- messages a retry row leased as before (ver 1, delivery 1): before some of them are acked, nacked or
-- reclaimed alone. Returns how many leases this call closed (one closed by another call is not).
CREATE FUNCTION {schema}.@Psplit(p_los bigint[]) RETURNS integer LANGUAGE plpgsql AS $b$
DECLARE
    v_closed bigint[] := ARRAY[]::bigint[];
    v_part bigint[];
    v_ids bigint[];
    v_due timestamptz[];
    v_who text[];
BEGIN
    FOR k IN 0 .. 3 LOOP
        CONTINUE WHEN NOT EXISTS (SELECT 1 FROM unnest(p_los) l WHERE (l >> 16) / @S % 4 = k);
        IF k = 0 THEN
            WITH d AS (INSERT INTO {schema}.@Pd0 SELECT e.lo FROM {schema}.@Pl0 e WHERE e.lo = ANY (p_los) ON CONFLICT DO NOTHING RETURNING lo)
            SELECT array_agg(d.lo) INTO v_part FROM d;
        ELSIF k = 1 THEN
            WITH d AS (INSERT INTO {schema}.@Pd1 SELECT e.lo FROM {schema}.@Pl1 e WHERE e.lo = ANY (p_los) ON CONFLICT DO NOTHING RETURNING lo)
            SELECT array_agg(d.lo) INTO v_part FROM d;
        ELSIF k = 2 THEN
            WITH d AS (INSERT INTO {schema}.@Pd2 SELECT e.lo FROM {schema}.@Pl2 e WHERE e.lo = ANY (p_los) ON CONFLICT DO NOTHING RETURNING lo)
            SELECT array_agg(d.lo) INTO v_part FROM d;
        ELSE
            WITH d AS (INSERT INTO {schema}.@Pd3 SELECT e.lo FROM {schema}.@Pl3 e WHERE e.lo = ANY (p_los) ON CONFLICT DO NOTHING RETURNING lo)
            SELECT array_agg(d.lo) INTO v_part FROM d;
        END IF;
        v_closed := v_closed || coalesce(v_part, ARRAY[]::bigint[]);
    END LOOP;
    IF cardinality(v_closed) = 0 THEN
        RETURN 0;
    END IF;
    SELECT array_agg(m.r_id), array_agg(m.r_until), array_agg(m.r_consumer) INTO v_ids, v_due, v_who
    FROM {schema}.@Plmsgs(v_closed) m;
    IF v_ids IS NOT NULL THEN
        PERFORM {schema}.@Pput(v_ids, array_fill(1, ARRAY[cardinality(v_ids)]),
            array_fill(2, ARRAY[cardinality(v_ids)]), array_fill(1, ARRAY[cardinality(v_ids)]),
            array_fill(1, ARRAY[cardinality(v_ids)]), v_due, v_who, NULL::text[]);
    END IF;
    RETURN cardinality(v_closed);
END
$b$
@;
-- The receipts (id, delivery) that still hold their lease: a first delivery inside an open lease that
-- has not expired (r_lo names it), or a message whose newest retry row is leased as that delivery and
-- has not expired (r_lo NULL). A message is in an open lease or has retry rows, never both.
CREATE FUNCTION {schema}.@Pheld(p_ids bigint[], p_deliveries integer[])
RETURNS TABLE (r_id bigint, r_delivery integer, r_lo bigint, r_until timestamptz) LANGUAGE sql AS $b$
    SELECT u.id, u.d, e.lo, e.lease_until
    FROM unnest(p_ids, p_deliveries) u(id, d)
    CROSS JOIN LATERAL (
        SELECT e.lo, e.lease_until FROM {schema}.@Pl e
        WHERE e.lo <= u.id AND e.hi >= u.id
          AND e.starts[((u.id >> 16) % @L)::integer + 1] <= u.id AND u.id < e.ends[((u.id >> 16) % @L)::integer + 1]
        ORDER BY e.lo DESC LIMIT 1) e
    WHERE u.d = 1 AND e.lease_until > now() AND NOT EXISTS (SELECT 1 FROM {schema}.@Pd d WHERE d.lo = e.lo)
    UNION ALL
    SELECT u.id, u.d, NULL::bigint, r.r_due
    FROM unnest(p_ids, p_deliveries) u(id, d)
    JOIN {schema}.@Pnewest(p_ids) r ON r.r_id = u.id
    WHERE r.r_state = 2 AND r.r_deliveries = u.d AND r.r_due > now()
$b$
@;
-- The usual ack: receipts naming every message of one open lease, first deliveries, before its end.
-- One done row closes it (its key: a second ack, or a reclaim, of the same lease writes nothing).
-- Returns the messages acked: all the receipts, or 0 (then the caller settles them with @Psettle).
-- On a ring ordered per key the done row frees the lanes the lease held, and with p_notify (the ring's
-- notify setting, as a push passes it: 0 never, 1 auto, 2 always) it wakes a waiting pop on p_channel
-- when one of them may have something to take (auto: the lease stopped inside a row of the lane, or a
-- row is issued past where it stopped; always: whenever it frees a lane): a waiting pop finds every lane
-- with messages held, and no push may come to wake it. A ring without ordering has no such parameters
-- and sends nothing.
CREATE FUNCTION {schema}.@Pack(p_ids bigint[], p_deliveries integer[]
@O    , p_notify integer DEFAULT 0, p_channel text DEFAULT NULL
    ) RETURNS integer
LANGUAGE plpgsql AS $b$
DECLARE
    v_lo bigint;
    v_n integer;
BEGIN
    IF EXISTS (SELECT 1 FROM unnest(p_deliveries) d WHERE d <> 1) THEN
        RETURN 0;
    END IF;
    SELECT min(i) INTO v_lo FROM unnest(p_ids) i;
    IF (v_lo >> 16) / @S % 4 = 0 THEN
        INSERT INTO {schema}.@Pd0 SELECT e.lo FROM {schema}.@Pl0 e
        WHERE e.lo = v_lo AND e.lease_until > now() AND e.n = cardinality(p_ids)
          AND (SELECT count(*) FROM unnest(p_ids) i WHERE i <= e.hi AND e.starts[((i >> 16) % @L)::integer + 1] <= i AND i < e.ends[((i >> 16) % @L)::integer + 1]) = e.n
        ON CONFLICT DO NOTHING;
    ELSIF (v_lo >> 16) / @S % 4 = 1 THEN
        INSERT INTO {schema}.@Pd1 SELECT e.lo FROM {schema}.@Pl1 e
        WHERE e.lo = v_lo AND e.lease_until > now() AND e.n = cardinality(p_ids)
          AND (SELECT count(*) FROM unnest(p_ids) i WHERE i <= e.hi AND e.starts[((i >> 16) % @L)::integer + 1] <= i AND i < e.ends[((i >> 16) % @L)::integer + 1]) = e.n
        ON CONFLICT DO NOTHING;
    ELSIF (v_lo >> 16) / @S % 4 = 2 THEN
        INSERT INTO {schema}.@Pd2 SELECT e.lo FROM {schema}.@Pl2 e
        WHERE e.lo = v_lo AND e.lease_until > now() AND e.n = cardinality(p_ids)
          AND (SELECT count(*) FROM unnest(p_ids) i WHERE i <= e.hi AND e.starts[((i >> 16) % @L)::integer + 1] <= i AND i < e.ends[((i >> 16) % @L)::integer + 1]) = e.n
        ON CONFLICT DO NOTHING;
    ELSE
        INSERT INTO {schema}.@Pd3 SELECT e.lo FROM {schema}.@Pl3 e
        WHERE e.lo = v_lo AND e.lease_until > now() AND e.n = cardinality(p_ids)
          AND (SELECT count(*) FROM unnest(p_ids) i WHERE i <= e.hi AND e.starts[((i >> 16) % @L)::integer + 1] <= i AND i < e.ends[((i >> 16) % @L)::integer + 1]) = e.n
        ON CONFLICT DO NOTHING;
    END IF;
    GET DIAGNOSTICS v_n = ROW_COUNT;
@O  IF v_n = 1 AND p_notify > 0 AND (p_notify = 2 OR EXISTS (
@O          SELECT 1 FROM {schema}.@Pl e CROSS JOIN LATERAL unnest(e.ends) x
@O          WHERE e.lo = v_lo AND ((x & 65535) <> 0 OR (x >> 16) <= pg_sequence_last_value('{schema}.@Prows')))) THEN
@O      PERFORM pg_notify(p_channel, '');
@O  END IF;
    RETURN CASE WHEN v_n = 1 THEN cardinality(p_ids) ELSE 0 END;
END
$b$
@;
-- Copy messages p_ids, failed after attempts p_att, to the schema's ring_failed with their payloads.
CREATE FUNCTION {schema}.@Pfail(p_ids bigint[], p_att integer[], p_errors text[]) RETURNS void
LANGUAGE sql AS $b$
    INSERT INTO {schema}.ring_failed (queue_id, id, attempts, enqueued_at, last_error, payload)
    SELECT @Q, u.id, u.a, t.enqueued_at, u.e, t.payloads[(u.id & 65535)::integer + 1]
    FROM unnest(p_ids, p_att, p_errors) u(id, a, e) JOIN {schema}.@Pq t ON t.r = u.id >> 16
    ON CONFLICT DO NOTHING
$b$
@;
-- Ack (p_nack false) or nack the deliveries named by receipts, all or nothing: when any receipt does not
-- hold its lease, or another call moved one of them on meanwhile, nothing is written and no row comes
-- back (the caller asks @Pheld which). The leases holding them are split first (@Psplit), so every
-- receipt is then a leased retry row; each gets a new row: finished (0), ready again after p_delay_s or
-- the backoff (1), or after p_max_attempts failed (3, its payload copied to ring_failed). Rows: (id,
-- state) of each, 0 finished, 1 ready again, 2 failed.
CREATE FUNCTION {schema}.@Psettle(p_ids bigint[], p_deliveries integer[], p_nack boolean,
    p_delay_s double precision, p_backoff_s double precision, p_backoff_max_s double precision,
    p_max_attempts integer, p_error text
@O    , p_notify integer DEFAULT 0, p_channel text DEFAULT NULL
    )
RETURNS TABLE (r_id bigint, r_state integer) LANGUAGE plpgsql AS $b$
DECLARE
@O    v_hold smallint[];
@O    v_free integer[];
    v_los bigint[];
    v_held integer;
    v_vers integer[];
    v_att integer[];
    v_del integer[];
    v_states integer[];
    v_due timestamptz[];
    v_n integer;
BEGIN
    SELECT array_agg(DISTINCT h.r_lo) FILTER (WHERE h.r_lo IS NOT NULL), count(*) INTO v_los, v_held
    FROM {schema}.@Pheld(p_ids, p_deliveries) h;
    IF v_held < cardinality(p_ids) THEN
        RETURN;
    END IF;
    BEGIN
        -- A lease closed by another call meanwhile (its done row's key: this insert waited for that call
        -- to end) is not split again here: the next statement, with a snapshot taken after, finds
        -- whether that call left its receipts leased (a concurrent split) or not (an ack, a reclaim).
        IF v_los IS NOT NULL THEN
            PERFORM {schema}.@Psplit(v_los);
        END IF;
        SELECT array_agg(r.r_ver + 1 ORDER BY u.o), array_agg(r.r_attempts ORDER BY u.o),
               array_agg(r.r_deliveries ORDER BY u.o), count(*)
        INTO v_vers, v_att, v_del, v_n
        FROM unnest(p_ids, p_deliveries) WITH ORDINALITY u(id, d, o)
        JOIN {schema}.@Pnewest(p_ids) r ON r.r_id = u.id
        WHERE r.r_state = 2 AND r.r_deliveries = u.d AND r.r_due > now();
        IF v_n < cardinality(p_ids) THEN
            RAISE EXCEPTION 'a receipt was settled meanwhile' USING ERRCODE = 'DQR01';
        END IF;
        SELECT array_agg(CASE WHEN NOT p_nack THEN 0 WHEN a >= p_max_attempts THEN 3 ELSE 1 END ORDER BY o),
               array_agg(CASE WHEN p_nack AND a < p_max_attempts THEN now() + make_interval(secs => coalesce(
                   p_delay_s, least(p_backoff_max_s, p_backoff_s * power(2, greatest(a - 1, 0))))) ELSE now() END ORDER BY o)
        INTO v_states, v_due FROM unnest(v_att) WITH ORDINALITY x(a, o);
        SELECT count(*) INTO v_n FROM {schema}.@Pput(p_ids, v_vers, v_states, v_att, v_del, v_due,
            array_fill(NULL::text, ARRAY[cardinality(p_ids)]), array_fill(p_error, ARRAY[cardinality(p_ids)]));
        IF v_n < cardinality(p_ids) THEN
            RAISE EXCEPTION 'a receipt was settled meanwhile' USING ERRCODE = 'DQR01';
        END IF;
        PERFORM {schema}.@Pfail(array_agg(u.id), array_agg(u.a), array_agg(p_error))
        FROM unnest(p_ids, v_att, v_states) u(id, a, s) WHERE u.s = 3 HAVING count(*) > 0;
    EXCEPTION WHEN SQLSTATE 'DQR01' THEN
        RETURN;
    END;
    -- Per key, with p_notify as @Pack's: a lane of these messages free now (@Pholds: nothing of it leased
    -- or delayed any more) with something to take (a message due again, or a row issued past its
    -- position, or its position inside a row) wakes a waiting pop; always: any lane of them free now.
@O  IF p_notify > 0 THEN
@O      v_hold := {schema}.@Pholds();
@O      v_free := ARRAY(SELECT DISTINCT ((i >> 16) % @L)::integer FROM unnest(p_ids) i);
@O      v_free := ARRAY(SELECT l FROM unnest(v_free) l WHERE v_hold[l + 1] <> 1);
@O      IF cardinality(v_free) > 0 AND (p_notify = 2 OR 2 = ANY (ARRAY(SELECT v_hold[l + 1] FROM unnest(v_free) l))
@O              OR EXISTS (SELECT 1 FROM unnest({schema}.@Planes(v_free)) x
@O                         WHERE (x & 65535) <> 0 OR (x >> 16) <= pg_sequence_last_value('{schema}.@Prows'))) THEN
@O          PERFORM pg_notify(p_channel, '');
@O      END IF;
@O  END IF;
    RETURN QUERY SELECT u.id, CASE u.s WHEN 3 THEN 2 ELSE u.s END FROM unnest(p_ids, v_states) u(id, s);
END
$b$
@;
-- Expired leases go back to ready as retry rows (keeping their ids) or, after p_max_attempts, to
-- ring_failed: open leases past their end (split first) and leased retry rows past theirs, up to p_limit
-- of each. Rows: (id, state) of each message moved, 1 ready again, 2 failed.
CREATE FUNCTION {schema}.@Preclaim(p_max_attempts integer, p_limit integer)
RETURNS TABLE (r_id bigint, r_state integer) LANGUAGE plpgsql AS $b$
DECLARE
    v_los bigint[];
    v_ids bigint[];
    v_vers integer[];
    v_att integer[];
    v_del integer[];
    v_states integer[];
    v_errors text[];
    v_done bigint[];
BEGIN
    SELECT array_agg(e.lo) INTO v_los FROM (
        SELECT e.lo FROM {schema}.@Pl e
        WHERE e.lease_until <= now() AND NOT EXISTS (SELECT 1 FROM {schema}.@Pd d WHERE d.lo = e.lo)
        ORDER BY e.lo LIMIT p_limit) e;
    IF v_los IS NOT NULL THEN
        PERFORM {schema}.@Psplit(v_los);
    END IF;
    SELECT array_agg(r.id ORDER BY r.id), array_agg(r.ver + 1 ORDER BY r.id), array_agg(r.attempts ORDER BY r.id),
           array_agg(r.deliveries ORDER BY r.id),
           array_agg(CASE WHEN r.attempts >= p_max_attempts THEN 3 ELSE 1 END ORDER BY r.id),
           array_agg('lease expired (held by ' || coalesce(r.consumer, '?') || ')' ORDER BY r.id)
    INTO v_ids, v_vers, v_att, v_del, v_states, v_errors
    FROM (
        SELECT r.* FROM {schema}.@Pr r
        WHERE r.state = 2 AND r.due_at <= now()
          AND NOT EXISTS (SELECT 1 FROM {schema}.@Pr x WHERE x.id = r.id AND x.ver > r.ver)
        ORDER BY r.id LIMIT p_limit) r;
    IF v_ids IS NULL THEN
        RETURN;
    END IF;
    SELECT array_agg(p.id) INTO v_done FROM {schema}.@Pput(v_ids, v_vers, v_states, v_att, v_del,
        array_fill(now(), ARRAY[cardinality(v_ids)]), array_fill(NULL::text, ARRAY[cardinality(v_ids)]), v_errors) p(id);
    PERFORM {schema}.@Pfail(array_agg(u.id), array_agg(u.a), array_agg(u.e))
    FROM unnest(v_ids, v_att, v_states, v_errors) u(id, a, s, e) WHERE u.s = 3 AND u.id = ANY (v_done)
    HAVING count(*) > 0;
    RETURN QUERY SELECT u.id, CASE u.s WHEN 3 THEN 2 ELSE 1 END FROM unnest(v_ids, v_states) u(id, s)
    WHERE u.id = ANY (v_done);
END
$b$
@;
-- Whether segment p_k still holds something a consumer needs besides the lanes: an open lease (no done
-- row), or a message to deliver again or leased again (its newest retry row ready or leased).
CREATE FUNCTION {schema}.@Pbusy(p_k integer) RETURNS boolean LANGUAGE plpgsql AS $b$
BEGIN
    IF p_k = 0 THEN
        RETURN EXISTS (SELECT 1 FROM {schema}.@Pl0 e WHERE NOT EXISTS (SELECT 1 FROM {schema}.@Pd0 d WHERE d.lo = e.lo))
            OR EXISTS (SELECT 1 FROM {schema}.@Pr0 r WHERE r.state IN (1, 2) AND NOT EXISTS (SELECT 1 FROM {schema}.@Pr0 x WHERE x.id = r.id AND x.ver > r.ver));
    ELSIF p_k = 1 THEN
        RETURN EXISTS (SELECT 1 FROM {schema}.@Pl1 e WHERE NOT EXISTS (SELECT 1 FROM {schema}.@Pd1 d WHERE d.lo = e.lo))
            OR EXISTS (SELECT 1 FROM {schema}.@Pr1 r WHERE r.state IN (1, 2) AND NOT EXISTS (SELECT 1 FROM {schema}.@Pr1 x WHERE x.id = r.id AND x.ver > r.ver));
    ELSIF p_k = 2 THEN
        RETURN EXISTS (SELECT 1 FROM {schema}.@Pl2 e WHERE NOT EXISTS (SELECT 1 FROM {schema}.@Pd2 d WHERE d.lo = e.lo))
            OR EXISTS (SELECT 1 FROM {schema}.@Pr2 r WHERE r.state IN (1, 2) AND NOT EXISTS (SELECT 1 FROM {schema}.@Pr2 x WHERE x.id = r.id AND x.ver > r.ver));
    ELSE
        RETURN EXISTS (SELECT 1 FROM {schema}.@Pl3 e WHERE NOT EXISTS (SELECT 1 FROM {schema}.@Pd3 d WHERE d.lo = e.lo))
            OR EXISTS (SELECT 1 FROM {schema}.@Pr3 r WHERE r.state IN (1, 2) AND NOT EXISTS (SELECT 1 FROM {schema}.@Pr3 x WHERE x.id = r.id AND x.ver > r.ver));
    END IF;
END
$b$
@;
-- What the ring holds: ready (the lanes' messages and those due again), delayed (due again later), in
-- flight (open leases' messages and leased retry rows), failed, the oldest ready one's push time, the
-- rows held, the segments' generations, the failed messages that failed by expiry, the messages whose
-- time to live has passed that no pop has reached yet (lapsed: a pop that reaches them fails or drops
-- them, so they are counted neither ready nor delayed), and the push total: the messages of every push
-- so far, those of the emptied segments (@Pemptied) and those held (a push rolled back wrote no row, and
-- counts nothing). The lapsed ones are counted exactly, in the same pass over the rows past the lanes
-- that counts the ready ones: each row's expires_at beside its n, no scan of its own; a ring without a
-- ttl counts none (its lines with @E are comments). One statement, so one snapshot: the lanes' positions
-- are read here from the position logs (a lane's highest entry over the live segments, what @Planes
-- finds), not through @Planes, whose statements would see pops committed after this one's snapshot; so
-- the push total less ready, delayed, in flight and lapsed is exactly what the group has finished. Its
-- cost is a scan of the rows held (at most the capacity) and 4 index probes a lane. On a ring ordered per
-- key, r_blocked is the part of r_ready (every waiting message) behind a lane a pop may not take now
-- (@Pblocked, in the same snapshot): the lanes' messages and those due again of the held lanes.
CREATE FUNCTION {schema}.@Pdepth(OUT r_ready bigint, OUT r_delayed bigint, OUT r_in_flight bigint,
    OUT r_failed bigint, OUT r_oldest timestamptz, OUT r_rows bigint, OUT r_gens bigint[],
    OUT r_expired bigint, OUT r_lapsed bigint, OUT r_pushed bigint
@O  , OUT r_blocked bigint
    )
LANGUAGE sql AS $b$
    WITH l AS MATERIALIZED (
        SELECT k AS lane, greatest(
            (SELECT max(p.at) FROM {schema}.@Ppos0 p WHERE p.lane = k), (SELECT max(p.at) FROM {schema}.@Ppos1 p WHERE p.lane = k),
            (SELECT max(p.at) FROM {schema}.@Ppos2 p WHERE p.lane = k), (SELECT max(p.at) FROM {schema}.@Ppos3 p WHERE p.lane = k)) AS at
        FROM generate_series(0, @L - 1) k),
@O  kh AS MATERIALIZED (SELECT {schema}.@Pblocked(ARRAY(SELECT l.at FROM l ORDER BY l.lane)) AS held),
    w AS (
        SELECT t.n - CASE WHEN t.r = l.at >> 16 THEN (l.at & 65535) ELSE 0 END AS n, t.enqueued_at, false
@E            OR coalesce(t.expires_at <= now(), false)
            AS lapsed
@O          , kh.held[l.lane + 1] AS blocked
        FROM l JOIN {schema}.@Pq t ON t.r % @L = l.lane AND t.r >= l.at >> 16
@O      CROSS JOIN kh
        ),
    s AS (
        SELECT coalesce(sum(w.n) FILTER (WHERE NOT w.lapsed), 0)::bigint AS ready,
               coalesce(sum(w.n) FILTER (WHERE w.lapsed), 0)::bigint AS lapsed,
@O             coalesce(sum(w.n) FILTER (WHERE NOT w.lapsed AND w.blocked), 0)::bigint AS blocked,
               min(w.enqueued_at) FILTER (WHERE NOT w.lapsed) AS oldest
        FROM w),
    h AS (SELECT count(*) AS rows, coalesce(sum(t.n), 0)::bigint AS msgs FROM {schema}.@Pq t),
    r AS (
        SELECT r.id, r.state, r.due_at, t.enqueued_at, false
@E            OR coalesce(t.expires_at <= now(), false)
            AS lapsed
@O          , kh.held[((r.id >> 16) % @L)::integer + 1] AS blocked
        FROM {schema}.@Pr r LEFT JOIN {schema}.@Pq t ON t.r = r.id >> 16
@O      CROSS JOIN kh
        WHERE r.state IN (1, 2) AND NOT EXISTS (SELECT 1 FROM {schema}.@Pr x WHERE x.id = r.id AND x.ver > r.ver))
    SELECT s.ready + (SELECT count(*) FROM r WHERE r.state = 1 AND r.due_at <= now() AND NOT r.lapsed),
           (SELECT count(*) FROM r WHERE r.state = 1 AND r.due_at > now() AND NOT r.lapsed),
           (SELECT coalesce(sum(e.n), 0) FROM {schema}.@Pl e
            WHERE NOT EXISTS (SELECT 1 FROM {schema}.@Pd d WHERE d.lo = e.lo)) + (SELECT count(*) FROM r WHERE r.state = 2),
           (SELECT count(*) FROM {schema}.ring_failed f WHERE f.queue_id = @Q),
           least(s.oldest, (SELECT min(r.enqueued_at) FROM r WHERE r.state = 1 AND r.due_at <= now() AND NOT r.lapsed)),
           h.rows,
           ARRAY(SELECT {schema}.@Pseg_gen(k) FROM generate_series(0, 3) k),
           (SELECT count(*) FROM {schema}.ring_failed f WHERE f.queue_id = @Q AND f.last_error = 'expired'),
           s.lapsed + (SELECT count(*) FROM r WHERE r.state = 1 AND r.lapsed),
           coalesce((SELECT max(e.total) FROM {schema}.@Pemptied e), 0) + h.msgs
@O         , s.blocked + (SELECT count(*) FROM r WHERE r.state = 1 AND r.due_at <= now() AND NOT r.lapsed AND r.blocked)
    FROM s CROSS JOIN h
$b$
@;
-- Claim a batch (p_batch) of up to p_n messages for group p_group: a pop at least once (@Ptake: messages
-- due again first, then the lanes'; leased until now + p_vt) recorded with its receipts, in id order, in
-- one row of @Pb. No row when nothing was taken. The batch's messages hold their segments as any lease
-- does (@Pbusy), until the batch is acked or released, or its lease expires and they are finished
-- elsewhere.
CREATE FUNCTION {schema}.@Pbclaim(p_batch uuid, p_group integer, p_n integer, p_wait boolean,
    p_vt double precision, p_consumer text)
RETURNS TABLE (r_batch uuid, r_state smallint, r_ids bigint[], r_deliveries integer[], r_consumer text,
               r_claimed_at timestamptz, r_lease_until timestamptz, r_finished_at timestamptz, r_error text)
LANGUAGE sql AS $b$
    WITH t AS MATERIALIZED (
        SELECT t.r_id, t.r_deliveries, t.r_lease_until FROM {schema}.@Ptake(p_n, p_wait, true, p_vt, p_consumer) t)
    INSERT INTO {schema}.@Pb (batch_id, grp, ids, deliveries, consumer, claimed_at, lease_until)
    SELECT p_batch, p_group, array_agg(t.r_id ORDER BY t.r_id), array_agg(t.r_deliveries ORDER BY t.r_id),
           p_consumer, now(), min(t.r_lease_until)
    FROM t HAVING count(*) > 0
    RETURNING batch_id, 0::smallint, ids, deliveries, consumer, claimed_at, lease_until, NULL::timestamptz, NULL::text
$b$
@;
-- A batch of group p_group as it stands (its claim and its newest state row); with p_lock, its claim row
-- locked first (a row lock writes no row version), so that an ack, a release and an extension of one
-- batch take their turns, each reading the state the one before left.
CREATE FUNCTION {schema}.@Pbget(p_batch uuid, p_group integer, p_lock boolean)
RETURNS TABLE (r_batch uuid, r_state smallint, r_ids bigint[], r_deliveries integer[], r_consumer text,
               r_claimed_at timestamptz, r_lease_until timestamptz, r_finished_at timestamptz, r_error text)
LANGUAGE plpgsql AS $b$
BEGIN
    IF p_lock THEN
        PERFORM 1 FROM {schema}.@Pb b WHERE b.batch_id = p_batch AND b.grp = p_group FOR UPDATE;
    END IF;
    RETURN QUERY
    SELECT b.batch_id, coalesce(s.state, 0::smallint), b.ids, b.deliveries, b.consumer, b.claimed_at,
           coalesce(s.lease_until, b.lease_until), s.finished_at, s.last_error
    FROM {schema}.@Pb b
    LEFT JOIN LATERAL (SELECT * FROM {schema}.@Pbs s WHERE s.batch_id = b.batch_id ORDER BY s.ver DESC LIMIT 1) s ON true
    WHERE b.batch_id = p_batch AND b.grp = p_group;
END
$b$
@;
-- A new state of batch p_batch (0 claimed, 1 acked, 2 released) as a row of @Pbs, the ver after its
-- newest: its lease end when given (else the one before), finished now unless claimed, its error when
-- given (else the one before). Under @Pbget's lock.
CREATE FUNCTION {schema}.@Pbset(p_batch uuid, p_group integer, p_state smallint, p_until timestamptz,
    p_error text)
RETURNS void LANGUAGE sql AS $b$
    INSERT INTO {schema}.@Pbs (batch_id, ver, state, lease_until, finished_at, last_error)
    SELECT b.batch_id, coalesce(s.ver, 0) + 1, p_state, coalesce(p_until, s.lease_until, b.lease_until),
           CASE WHEN p_state = 0 THEN NULL ELSE now() END, coalesce(p_error, s.last_error)
    FROM {schema}.@Pb b
    LEFT JOIN LATERAL (SELECT * FROM {schema}.@Pbs s WHERE s.batch_id = b.batch_id ORDER BY s.ver DESC LIMIT 1) s ON true
    WHERE b.batch_id = p_batch AND b.grp = p_group
$b$
@;
-- Group p_group's batches still claimed, oldest first, up to p_limit; with p_prefix, only those whose
-- consumer starts with it (compared as text: LIKE's wildcards are plain characters here).
CREATE FUNCTION {schema}.@Pbopen(p_group integer, p_limit integer, p_prefix text)
RETURNS TABLE (r_batch uuid, r_state smallint, r_ids bigint[], r_deliveries integer[], r_consumer text,
               r_claimed_at timestamptz, r_lease_until timestamptz, r_finished_at timestamptz, r_error text)
LANGUAGE sql AS $b$
    SELECT b.batch_id, 0::smallint, b.ids, b.deliveries, b.consumer, b.claimed_at,
           coalesce(s.lease_until, b.lease_until), NULL::timestamptz, s.last_error
    FROM {schema}.@Pb b
    LEFT JOIN LATERAL (SELECT * FROM {schema}.@Pbs s WHERE s.batch_id = b.batch_id ORDER BY s.ver DESC LIMIT 1) s ON true
    WHERE b.grp = p_group AND coalesce(s.state, 0) = 0
      AND (p_prefix IS NULL OR left(b.consumer, length(p_prefix)) = p_prefix)
    ORDER BY b.claimed_at
    LIMIT p_limit
$b$
@;
-- Forget up to p_n batches of group p_group finished (acked or released) more than p_older_than_s ago:
-- their claim and state rows. The upkeep's, not the hot path's: the only statement on these tables
-- that deletes.
CREATE FUNCTION {schema}.@Pbpurge(p_group integer, p_older_than_s double precision, p_n integer)
RETURNS SETOF uuid LANGUAGE sql AS $b$
    WITH f AS MATERIALIZED (
        SELECT b.batch_id FROM {schema}.@Pb b
        CROSS JOIN LATERAL (SELECT * FROM {schema}.@Pbs s WHERE s.batch_id = b.batch_id ORDER BY s.ver DESC LIMIT 1) s
        WHERE b.grp = p_group AND s.state <> 0 AND s.finished_at < now() - make_interval(secs => p_older_than_s)
        LIMIT p_n),
    d AS (DELETE FROM {schema}.@Pbs s USING f WHERE s.batch_id = f.batch_id)
    DELETE FROM {schema}.@Pb b USING f WHERE b.batch_id = f.batch_id RETURNING b.batch_id
$b$
@;
-- The messages of batch p_batch with their payloads, numbered 1..n in id order (r_ord: a Spark JDBC
-- reader partitions on it), read row by row in the segment of each row number (each row read once, its
-- payloads taken from the array in hand). Row numbers are never issued twice, so a segment emptied and
-- reused since holds no row of the batch's numbers: its messages read as a NULL payload, as do those of a
-- segment that does not hold their generation now (checked first, so that its table is not read at all).
-- A batch whose payloads are gone was finished elsewhere after its lease expired; it cannot be acked.
CREATE FUNCTION {schema}.@Pbrows(p_batch uuid, p_group integer)
RETURNS TABLE (r_ord bigint, r_id bigint, r_delivery integer, r_payload bytea) LANGUAGE plpgsql STABLE AS $b$
DECLARE
    v_ids bigint[];
    v_del integer[];
    v_pl bytea[];
    v_r bigint := -1;
    v_k integer;
BEGIN
    SELECT b.ids, b.deliveries INTO v_ids, v_del FROM {schema}.@Pb b WHERE b.batch_id = p_batch AND b.grp = p_group;
    IF v_ids IS NULL THEN
        RETURN;
    END IF;
    FOR i IN 1 .. cardinality(v_ids) LOOP
        IF v_ids[i] >> 16 <> v_r THEN
            v_r := v_ids[i] >> 16;
            v_k := (v_r / @S % 4)::integer;
            v_pl := NULL;
            IF {schema}.@Pseg_gen(v_k) = v_r / @S THEN
                IF v_k = 0 THEN
                    SELECT t.payloads INTO v_pl FROM {schema}.@Pq0 t WHERE t.r = v_r;
                ELSIF v_k = 1 THEN
                    SELECT t.payloads INTO v_pl FROM {schema}.@Pq1 t WHERE t.r = v_r;
                ELSIF v_k = 2 THEN
                    SELECT t.payloads INTO v_pl FROM {schema}.@Pq2 t WHERE t.r = v_r;
                ELSE
                    SELECT t.payloads INTO v_pl FROM {schema}.@Pq3 t WHERE t.r = v_r;
                END IF;
            END IF;
        END IF;
        r_ord := i;
        r_id := v_ids[i];
        r_delivery := v_del[i];
        r_payload := v_pl[(v_ids[i] & 65535)::integer + 1];
        RETURN NEXT;
    END LOOP;
END
$b$
@;
-- Push the leases of receipts p_ids/p_deliveries out to p_secs from now, all or nothing: r_n is how many
-- were extended (all of them, or 0 when one does not hold its lease, or another call moved one on
-- meanwhile: nothing is written then), r_until their new end. The leases holding them are split first
-- (@Psplit), and each receipt gets a new retry row, leased as the same delivery until r_until.
CREATE FUNCTION {schema}.@Pbextend(p_ids bigint[], p_deliveries integer[], p_secs double precision,
    OUT r_n integer, OUT r_until timestamptz) LANGUAGE plpgsql AS $b$
DECLARE
    v_los bigint[];
    v_held integer;
    v_vers integer[];
    v_att integer[];
    v_del integer[];
    v_who text[];
    v_n integer;
BEGIN
    r_n := 0;
    r_until := now() + make_interval(secs => p_secs);
    SELECT array_agg(DISTINCT h.r_lo) FILTER (WHERE h.r_lo IS NOT NULL), count(*) INTO v_los, v_held
    FROM {schema}.@Pheld(p_ids, p_deliveries) h;
    IF v_held < cardinality(p_ids) THEN
        RETURN;
    END IF;
    BEGIN
        IF v_los IS NOT NULL THEN
            PERFORM {schema}.@Psplit(v_los);
        END IF;
        SELECT array_agg(r.r_ver + 1 ORDER BY u.o), array_agg(r.r_attempts ORDER BY u.o),
               array_agg(r.r_deliveries ORDER BY u.o), array_agg(r.r_consumer ORDER BY u.o), count(*)
        INTO v_vers, v_att, v_del, v_who, v_n
        FROM unnest(p_ids, p_deliveries) WITH ORDINALITY u(id, d, o)
        JOIN {schema}.@Pnewest(p_ids) r ON r.r_id = u.id
        WHERE r.r_state = 2 AND r.r_deliveries = u.d AND r.r_due > now();
        IF v_n < cardinality(p_ids) THEN
            RAISE EXCEPTION 'a receipt was settled meanwhile' USING ERRCODE = 'DQR01';
        END IF;
        SELECT count(*) INTO v_n FROM {schema}.@Pput(p_ids, v_vers, array_fill(2, ARRAY[cardinality(p_ids)]),
            v_att, v_del, array_fill(r_until, ARRAY[cardinality(p_ids)]), v_who,
            array_fill(NULL::text, ARRAY[cardinality(p_ids)]));
        IF v_n < cardinality(p_ids) THEN
            RAISE EXCEPTION 'a receipt was settled meanwhile' USING ERRCODE = 'DQR01';
        END IF;
    EXCEPTION WHEN SQLSTATE 'DQR01' THEN
        RETURN;
    END;
    r_n := cardinality(p_ids);
END
$b$
@;
-- The messages of the receipts that still hold their lease, with their payloads, in id order (each row
-- read once).
CREATE FUNCTION {schema}.@Pleased(p_ids bigint[], p_deliveries integer[])
RETURNS TABLE (r_id bigint, r_attempts integer, r_deliveries integer, r_enqueued_at timestamptz,
               r_lease_until timestamptz, r_payload bytea)
LANGUAGE plpgsql AS $b$
DECLARE
    rec record;
    v_r bigint := -1;
    v_pl bytea[];
    v_ts timestamptz;
BEGIN
    FOR rec IN
        SELECT h.r_id AS id, h.r_delivery AS d, h.r_until AS until, coalesce(n.r_attempts, 1) AS att
        FROM {schema}.@Pheld(p_ids, p_deliveries) h
        LEFT JOIN {schema}.@Pnewest(p_ids) n ON n.r_id = h.r_id AND h.r_lo IS NULL
        ORDER BY h.r_id
    LOOP
        IF rec.id >> 16 <> v_r THEN
            v_r := rec.id >> 16;
            SELECT t.payloads, t.enqueued_at INTO v_pl, v_ts FROM {schema}.@Pq t WHERE t.r = v_r;
        END IF;
        r_id := rec.id;
        r_attempts := rec.att;
        r_deliveries := rec.d;
        r_enqueued_at := v_ts;
        r_lease_until := rec.until;
        r_payload := v_pl[(rec.id & 65535)::integer + 1];
        RETURN NEXT;
    END LOOP;
END
$b$
$x$ $t$;

-- Make a ring of the rows layout (its registry row, tables, sequences and functions, from
-- ring_rows_template). Its capacity is in rows (pushes): a quarter of it a segment.
CREATE OR REPLACE FUNCTION {schema}.ring_rows_create(p_queue_id integer, p_capacity integer, p_lanes integer)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_stmt text;
    v_x text;
    v_o text;
BEGIN
    INSERT INTO {schema}.ring_rows (queue_id, capacity, lanes, seg_rows)
    VALUES (p_queue_id, p_capacity, p_lanes, p_capacity / 4);
    -- @E starts the lines only a ring that expires (created with a ttl) has; a comment's start otherwise.
    -- @O starts those only a ring ordered per key has, @U those only a ring without ordering has.
    v_x := CASE WHEN (SELECT q.ttl_s IS NOT NULL FROM {schema}.queues q WHERE q.queue_id = p_queue_id) THEN '' ELSE '--' END;
    v_o := CASE WHEN (SELECT q.ordering = 'per_key' FROM {schema}.queues q WHERE q.queue_id = p_queue_id) THEN '' ELSE '--' END;
    FOREACH v_stmt IN ARRAY string_to_array({schema}.ring_rows_template(), '@;') LOOP
        EXECUTE replace(replace(replace(replace(replace(replace(replace(replace(replace(replace(replace(v_stmt,
            '@P', 'ring_' || p_queue_id || '_r'), '@L', p_lanes::text), '@S', (p_capacity / 4)::text),
            '@K1', hashtext('dbqueue.rows.push.{schema}.' || p_queue_id)::text),
            '@K2', hashtext('dbqueue.rows.lanes.{schema}.' || p_queue_id)::text),
            '@K3', hashtext('dbqueue.rows.posgen.{schema}.' || p_queue_id)::text),
            '@K4', hashtext('dbqueue.rows.retry.{schema}.' || p_queue_id)::text), '@Q', p_queue_id::text),
            '@E', v_x), '@O', v_o), '@U', CASE WHEN v_o = '' THEN '--' ELSE '' END);
    END LOOP;
END
$$;

-- Drop a ring of the rows layout: its tables, view, sequences, functions and registry row, and its
-- groups' own objects. Nothing when the ring is not of that layout.
CREATE OR REPLACE FUNCTION {schema}.ring_rows_drop(p_queue_id integer)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    -- The readers that reach the ring's own objects through ring_rows_look, ring_rows_ready and
    -- ring_rows_tally take this lock shared before any of them, and a drop takes it (the ring's and
    -- each group's) before its first DDL: a reader then either ran before the drop, or waits for it and
    -- finds the ring gone, and never holds one of the ring's tables while it waits for another that the
    -- drop holds (the cycle that the drop's retries under a short lock_timeout cannot always break
    -- while readers keep coming). An advisory lock writes nothing.
    PERFORM pg_advisory_xact_lock(hashtext('dbqueue.rows.drop.{schema}'), p_queue_id);
    PERFORM pg_advisory_xact_lock(hashtext('dbqueue.rows.drop.{schema}'), g.gid) FROM {schema}.ring_groups g WHERE g.queue_id = p_queue_id;
    DELETE FROM {schema}.ring_rows WHERE queue_id = p_queue_id;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    -- Its groups' own objects too, in the same step (uninstall drops the rings before ring_groups; a
    -- ring dropped alone has dropped its groups first, ring_drop).
    IF EXISTS (SELECT 1 FROM {schema}.ring_groups g WHERE g.queue_id = p_queue_id) THEN
        PERFORM {schema}.ring_rows_groups_lock(p_queue_id);
    END IF;
    PERFORM {schema}.ring_rows_drop_own(ARRAY['ring_' || p_queue_id || '_r'] || ARRAY(
        SELECT {schema}.ring_rows_own(g.gid) FROM {schema}.ring_groups g WHERE g.queue_id = p_queue_id));
END
$$;

-- Drop the functions, views, tables and sequences whose names start with one of p_prefixes (a rows
-- ring's own objects, or a group's), all of them or none. Readers (stats, peek, readiness, the groups'
-- positions) take their locks on these objects in their statements' own order: one that holds one of
-- them while it waits behind the drop's lock on another would deadlock with a drop that waited for
-- each in turn. So the drop runs under a lock_timeout and, when a lock is not granted in time, undoes
-- what it dropped, releasing every lock it took, and tries again. The timeout starts at 50 ms and
-- doubles up to 300 ms (a reader's statement on a loaded server may hold its lock longer than the first
-- tries wait), well below the server's deadlock_timeout (1 s by default), so that a drop caught in a
-- cycle with a reader gives up first; after 30 s of that it waits for its locks as any DROP does.
CREATE OR REPLACE FUNCTION {schema}.ring_rows_drop_own(p_prefixes text[])
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_lock_timeout text := current_setting('lock_timeout');
    v_until timestamptz := clock_timestamp() + interval '30 seconds';
    v_wait integer := 50;
    v_p text;
    o record;
BEGIN
    LOOP
        BEGIN
            IF clock_timestamp() < v_until THEN
                PERFORM set_config('lock_timeout', v_wait || 'ms', true);
            END IF;
            FOREACH v_p IN ARRAY p_prefixes LOOP
                FOR o IN
                    SELECT p.oid::regprocedure AS f FROM pg_catalog.pg_proc p
                    WHERE p.pronamespace = '{schema}'::regnamespace AND left(p.proname, length(v_p)) = v_p
                LOOP
                    EXECUTE format('DROP FUNCTION IF EXISTS %s', o.f);
                END LOOP;
                FOR o IN
                    SELECT c.oid::regclass AS v FROM pg_catalog.pg_class c
                    WHERE c.relnamespace = '{schema}'::regnamespace AND left(c.relname, length(v_p)) = v_p
                      AND c.relkind = 'v'
                LOOP
                    EXECUTE format('DROP VIEW IF EXISTS %s', o.v);
                END LOOP;
                FOR o IN
                    SELECT c.oid::regclass AS t, c.relkind FROM pg_catalog.pg_class c
                    WHERE c.relnamespace = '{schema}'::regnamespace AND left(c.relname, length(v_p)) = v_p
                      AND c.relkind IN ('r', 'S')
                LOOP
                    EXECUTE format(CASE WHEN o.relkind = 'r' THEN 'DROP TABLE IF EXISTS %s'
                                        ELSE 'DROP SEQUENCE IF EXISTS %s' END, o.t);
                END LOOP;
            END LOOP;
            PERFORM set_config('lock_timeout', v_lock_timeout, true);
            RETURN;
        EXCEPTION WHEN lock_not_available THEN
            v_wait := least(2 * v_wait, 300);
            PERFORM pg_sleep(0.005 + 0.02 * random());
        END;
    END LOOP;
END
$$;

-- Consumer groups of a ring of the rows layout. A group other than the default one has its own copy of
-- the template's per-consumer objects (lane position logs, leases, done rows, retry log, their
-- sequences and the functions that take, ack, settle, reclaim, peek, give up gaps and count), named
-- ring_g<-gid>_r* (ring_rows_own), over the ring's own segment tables and generation labels: a group's
-- pops, acks and nacks write only its own insert-only rows, as the default group's do, and a push writes
-- one row that every group reads. A segment is emptied only when every group is past it
-- (ring_rows_rotate_groups). Adding or dropping a group and a rotation take one lock of the ring
-- (ring_rows_groups_lock), so that a rotation sees every group that needs the segment it empties.

-- The prefix of the own objects of p_id: a ring's queue_id (its default group) or a group's gid.
CREATE OR REPLACE FUNCTION {schema}.ring_rows_own(p_id integer) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN p_id < 0 THEN 'ring_g' || -p_id || '_r' ELSE 'ring_' || p_id || '_r' END
$$;

-- Serialize adding and dropping a group of ring p_queue_id with its rotations (to the transaction's end).
CREATE OR REPLACE FUNCTION {schema}.ring_rows_groups_lock(p_queue_id integer) RETURNS void
LANGUAGE sql AS $$
    SELECT pg_advisory_xact_lock(hashtext('dbqueue.rows.groups.{schema}.' || p_queue_id))
$$;

-- Each lane's position (an id) of p_id: a ring's queue_id (its default group) or a group's gid.
CREATE OR REPLACE FUNCTION {schema}.ring_rows_positions(p_id integer) RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    v_at bigint[];
BEGIN
    EXECUTE 'SELECT {schema}.' || {schema}.ring_rows_own(p_id) || 'lanes(NULL)' INTO v_at;
    RETURN v_at;
END
$$;

-- Whether some group of ring p_queue_id besides its default one has every lane at or past row p_r (a
-- push's notify="auto": its consumers may be waiting for that row).
CREATE OR REPLACE FUNCTION {schema}.ring_rows_caught_up(p_queue_id integer, p_r bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_floor bigint;
    g record;
BEGIN
    FOR g IN SELECT x.gid FROM {schema}.ring_groups x WHERE x.queue_id = p_queue_id LOOP
        EXECUTE 'SELECT {schema}.' || {schema}.ring_rows_own(g.gid) || 'floor()' INTO v_floor;
        IF v_floor >= p_r THEN
            RETURN true;
        END IF;
    END LOOP;
    RETURN false;
END
$$;

-- Add a consumer group to ring p_queue_id of the rows layout: its ring_groups row (a new gid), its own
-- objects from ring_rows_template (those of the ring's messages, its generation labels, the totals of
-- its emptied segments, its push, rotation and labelling are the ring's, not copied; its batch ledger and the functions of batches are
-- its own, over its own leases, so an open batch of the group holds its segments as its pops' leases
-- do: ring_rows_rotate_groups asks every group's busy), and its lanes' first positions, logged as a pop
-- logs them: p_earliest, each lane's lowest position over the ring's groups (the group sees every
-- message some group has not taken yet; those other groups hold leased or to deliver again are
-- theirs); otherwise each lane's first row past the last row issued (what is pushed from now on).
-- Either way no lane starts below the floor. Returns the gid, or NULL when no such ring of the rows
-- layout exists; a name taken raises unique_violation (ring_groups_name_key).
CREATE OR REPLACE FUNCTION {schema}.ring_rows_add_group(
    p_queue_id integer, p_name text, p_earliest boolean, p_on_lag smallint, p_lag_timeout_s double precision)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    v_lanes integer;
    v_s integer;
    v_gid integer;
    v_own text;
    v_ring text := {schema}.ring_rows_own(p_queue_id);
    v_stmt text;
    v_last bigint;
    v_at bigint[];
    g record;
BEGIN
    SELECT w.lanes, w.seg_rows INTO v_lanes, v_s FROM {schema}.ring_rows w WHERE w.queue_id = p_queue_id;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    PERFORM {schema}.ring_rows_groups_lock(p_queue_id);
    v_gid := -nextval('{schema}.group_gids')::integer;
    INSERT INTO {schema}.ring_groups (queue_id, gid, name, on_lag, lag_timeout_s)
    VALUES (p_queue_id, v_gid, p_name, p_on_lag, p_lag_timeout_s);
    v_own := {schema}.ring_rows_own(v_gid);
    IF p_earliest THEN
        v_at := {schema}.ring_rows_positions(p_queue_id);
        FOR g IN SELECT x.gid FROM {schema}.ring_groups x WHERE x.queue_id = p_queue_id AND x.gid <> v_gid LOOP
            SELECT array_agg(least(u.a, u.b) ORDER BY u.o) INTO v_at
            FROM unnest(v_at, {schema}.ring_rows_positions(g.gid)) WITH ORDINALITY u(a, b, o);
        END LOOP;
    ELSE
        EXECUTE format('SELECT coalesce(pg_sequence_last_value(%L), -1)', '{schema}.' || v_ring || 'rows')
            INTO v_last;
        v_at := ARRAY(SELECT (v_last + 1 + (k - (v_last + 1) % v_lanes + v_lanes) % v_lanes) << 16
                      FROM generate_series(0, v_lanes - 1) k ORDER BY k);
    END IF;
    FOREACH v_stmt IN ARRAY string_to_array({schema}.ring_rows_template(), '@;') LOOP
        CONTINUE WHEN regexp_replace(v_stmt, '^(\s|--[^\n]*\n)*', '') ~ ('^(CREATE (SEQUENCE|TABLE|VIEW|FUNCTION) '
            || '\S+\.@P(gen[0-3]|rows|q[0-3]?|emptied[0-3]?|push[xko]?|rotate|label|keys|forget)\M'
            || '|CREATE INDEX @Pkeys_|ALTER TABLE \S+\.@Pq|SELECT setval|INSERT INTO )');
        EXECUTE replace(replace(replace(replace(replace(replace(replace(replace(replace(replace(
            regexp_replace(v_stmt, '@P(gen[0-3]|rows|q[0-3]?|emptied[0-3]?)\M', v_ring || '\1', 'g'),
            '@P', v_own), '@L', v_lanes::text), '@S', v_s::text),
            '@K2', hashtext('dbqueue.rows.lanes.{schema}.' || v_gid)::text),
            '@K3', hashtext('dbqueue.rows.posgen.{schema}.' || v_gid)::text),
            '@K4', hashtext('dbqueue.rows.retry.{schema}.' || v_gid)::text), '@Q', v_gid::text),
            '@E', CASE WHEN (SELECT q.ttl_s IS NOT NULL FROM {schema}.queues q WHERE q.queue_id = p_queue_id) THEN '' ELSE '--' END),
            '@O', CASE WHEN (SELECT q.ordering = 'per_key' FROM {schema}.queues q WHERE q.queue_id = p_queue_id) THEN '' ELSE '--' END),
            '@U', CASE WHEN (SELECT q.ordering = 'per_key' FROM {schema}.queues q WHERE q.queue_id = p_queue_id) THEN '--' ELSE '' END);
    END LOOP;
    EXECUTE 'SELECT {schema}.' || v_own || 'log($1, $2)' USING ARRAY(SELECT generate_series(0, v_lanes - 1)), v_at;
    RETURN v_gid;
END
$$;

-- Drop consumer group p_gid's own objects (ring_rows_add_group); nothing when it has none (a group of a
-- ring of the slots layout).
CREATE OR REPLACE FUNCTION {schema}.ring_rows_drop_group(p_queue_id integer, p_gid integer)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_p text := {schema}.ring_rows_own(p_gid);
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_class c
                   WHERE c.relnamespace = '{schema}'::regnamespace AND left(c.relname, length(v_p)) = v_p) THEN
        RETURN;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtext('dbqueue.rows.drop.{schema}'), p_gid);  -- as ring_rows_drop's
    PERFORM {schema}.ring_rows_groups_lock(p_queue_id);
    PERFORM {schema}.ring_rows_drop_own(ARRAY[v_p]);
END
$$;

-- A rotation of a ring with groups (ring_rows_rotate, under ring_rows_groups_lock): what the ring's own
-- rotation does, over every group. Empty the segment generation p_gen needs once every group's lanes
-- are past it by a lane's width of rows and none of its groups still needs it (an open lease, a message
-- to deliver again or leased again), the segment before it being emptied first: the ring's messages and
-- every group's logs of it, in one TRUNCATE under a 50 ms lock_timeout. True when it is empty or
-- p_gen's already, false otherwise (the caller then labels it, as after the ring's own rotation).
CREATE OR REPLACE FUNCTION {schema}.ring_rows_rotate_groups(p_queue_id integer, p_gen bigint) RETURNS boolean
LANGUAGE plpgsql SET lock_timeout = '50ms' AS $$
DECLARE
    v_k integer := (p_gen % 4)::integer;
    v_ring text := '{schema}.' || {schema}.ring_rows_own(p_queue_id);
    v_own text[];
    v_s bigint;
    v_l integer;
    v_gen bigint;
    v_prev bigint;
    v_floor bigint;
    v_busy boolean;
    v_tables text;
    v_p text;
    v_total bigint;
BEGIN
    SELECT w.seg_rows, w.lanes INTO v_s, v_l FROM {schema}.ring_rows w WHERE w.queue_id = p_queue_id;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    v_own := ARRAY[v_ring] || ARRAY(
        SELECT '{schema}.' || {schema}.ring_rows_own(g.gid) FROM {schema}.ring_groups g
        WHERE g.queue_id = p_queue_id ORDER BY g.gid DESC);
    EXECUTE format('SELECT %sseg_gen($1), %sseg_gen($2)', v_ring, v_ring) INTO v_gen, v_prev
        USING v_k, ((p_gen + 3) % 4)::integer;
    IF v_gen >= p_gen THEN
        RETURN true;
    END IF;
    IF v_prev < p_gen - 1 THEN
        RETURN false;
    END IF;
    FOREACH v_p IN ARRAY v_own LOOP
        EXECUTE format('SELECT %sfloor()', v_p) INTO v_floor;
        IF v_floor < (p_gen - 3) * v_s + v_l THEN
            RETURN false;
        END IF;
        EXECUTE format('SELECT %sbusy($1)', v_p) INTO v_busy USING v_k;
        IF v_busy THEN
            RETURN false;
        END IF;
    END LOOP;
    v_tables := v_ring || 'q' || v_k || ', ' || v_ring || 'emptied' || v_k;
    FOREACH v_p IN ARRAY v_own LOOP
        v_tables := v_tables || format(', %1$spos%2$s, %1$sl%2$s, %1$sd%2$s, %1$sr%2$s', v_p, v_k);
    END LOOP;
    EXECUTE 'LOCK TABLE ' || v_tables || ' IN ACCESS EXCLUSIVE MODE';
    EXECUTE format('SELECT %sseg_gen($1)', v_ring) INTO v_gen USING v_k;
    IF v_gen >= p_gen THEN
        RETURN true;
    END IF;
    FOREACH v_p IN ARRAY v_own LOOP  -- again under the locks: nothing can make it busy again, but be sure
        EXECUTE format('SELECT %sbusy($1)', v_p) INTO v_busy USING v_k;
        IF v_busy THEN
            RETURN false;
        END IF;
    END LOOP;
    -- The push total's part of the emptied segments, this one's messages added (the ring's own rotation
    -- says why, @Protate).
    EXECUTE format('SELECT coalesce((SELECT max(e.total) FROM %1$semptied e), 0) '
                   '+ (SELECT coalesce(sum(t.n), 0) FROM %1$sq%2$s t)', v_ring, v_k) INTO v_total;
    EXECUTE 'TRUNCATE ' || v_tables;
    EXECUTE format('INSERT INTO %semptied%s VALUES ($1)', v_ring, v_k) USING v_total;
    RETURN true;
EXCEPTION WHEN lock_not_available THEN
    RETURN false;
END
$$;

-- The other calls of a ring of the rows layout, by its queue_id: each runs the ring's own function. The
-- hot path (a push, a pop, the ack of a whole pop) calls the ring's own functions by their names instead
-- (queries/ring.sql): a call through EXECUTE is parsed and planned again on every run.
CREATE OR REPLACE FUNCTION {schema}.ring_rows_settle(
    p_queue_id integer, p_ids bigint[], p_deliveries integer[], p_nack boolean, p_delay_s double precision,
    p_backoff_s double precision, p_backoff_max_s double precision, p_max_attempts integer, p_error text)
RETURNS TABLE (r_id bigint, r_state integer) LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY EXECUTE 'SELECT * FROM {schema}.' || {schema}.ring_rows_own(p_queue_id) || 'settle($1, $2, $3, $4, $5, $6, $7, $8)'
        USING p_ids, p_deliveries, p_nack, p_delay_s, p_backoff_s, p_backoff_max_s, p_max_attempts, p_error;
END
$$;

CREATE OR REPLACE FUNCTION {schema}.ring_rows_held(p_queue_id integer, p_ids bigint[], p_deliveries integer[])
RETURNS TABLE (r_id bigint, r_delivery integer) LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY EXECUTE 'SELECT r_id, r_delivery FROM {schema}.' || {schema}.ring_rows_own(p_queue_id) || 'held($1, $2)'
        USING p_ids, p_deliveries;
END
$$;

CREATE OR REPLACE FUNCTION {schema}.ring_rows_reclaim(p_queue_id integer, p_max_attempts integer, p_limit integer)
RETURNS TABLE (r_id bigint, r_state integer) LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY EXECUTE 'SELECT * FROM {schema}.' || {schema}.ring_rows_own(p_queue_id) || 'reclaim($1, $2)'
        USING p_max_attempts, p_limit;
END
$$;

-- The client of the release before peeks through this; ring_rows_look replaces it (it adds each
-- message's attempts and deliveries so far).
CREATE OR REPLACE FUNCTION {schema}.ring_rows_peek(p_queue_id integer, p_n integer)
RETURNS TABLE (r_id bigint, r_enqueued_at timestamptz, r_payload bytea) LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY EXECUTE 'SELECT * FROM {schema}.' || {schema}.ring_rows_own(p_queue_id) || 'peek($1)' USING p_n;
END
$$;

-- Up to p_n ready messages of p_queue_id (a ring's queue_id or a group's gid) as its own look() shows
-- them (id, attempts and deliveries so far, push time, payload). A ring made by a build without look()
-- has its peek() read instead, each message with the attempts and deliveries of its newest retry row
-- (none: 0 and 0, a lane's message).
CREATE OR REPLACE FUNCTION {schema}.ring_rows_look(p_queue_id integer, p_n integer)
RETURNS TABLE (r_id bigint, r_attempts integer, r_deliveries integer, r_enqueued_at timestamptz, r_payload bytea)
LANGUAGE plpgsql AS $$
DECLARE
    v_own text := '{schema}.' || {schema}.ring_rows_own(p_queue_id);
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtext('dbqueue.rows.drop.{schema}'), p_queue_id);  -- before any of its objects: ring_rows_drop
    IF to_regprocedure(v_own || 'look(integer)') IS NOT NULL THEN
        RETURN QUERY EXECUTE 'SELECT * FROM ' || v_own || 'look($1)' USING p_n;
        RETURN;
    END IF;
    RETURN QUERY EXECUTE 'WITH p AS MATERIALIZED (SELECT k.*, row_number() OVER () AS o FROM ' || v_own
        || 'peek($1) k) SELECT p.r_id, coalesce(n.r_attempts, 0), coalesce(n.r_deliveries, 0), p.r_enqueued_at, '
        || 'p.r_payload FROM p LEFT JOIN ' || v_own || 'newest((SELECT array_agg(p.r_id) FROM p)) n '
        || 'ON n.r_id = p.r_id ORDER BY p.o' USING p_n;
END
$$;

-- What an observer of p_queue_id (a ring's queue_id or a group's gid) waits on, as its own ready()
-- counts it: the messages a pop could take now, up to p_cap (leases past their end with an attempt left
-- included, before anything reclaimed them), and the id and deliveries of the one it would take first.
-- A ring made by a build without ready() counts as its depth() does (a lease past its end only once
-- reclaimed), its head the first of look's.
CREATE OR REPLACE FUNCTION {schema}.ring_rows_ready(p_queue_id integer, p_cap bigint, p_max_attempts integer,
    OUT r_ready bigint, OUT r_head_id bigint, OUT r_head_deliveries integer)
LANGUAGE plpgsql AS $$
DECLARE
    v_own text := '{schema}.' || {schema}.ring_rows_own(p_queue_id);
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtext('dbqueue.rows.drop.{schema}'), p_queue_id);  -- before any of its objects: ring_rows_drop
    IF to_regprocedure(v_own || 'ready(bigint,integer)') IS NOT NULL THEN
        EXECUTE 'SELECT * FROM ' || v_own || 'ready($1, $2)' INTO r_ready, r_head_id, r_head_deliveries
            USING p_cap, p_max_attempts;
        RETURN;
    END IF;
    EXECUTE 'SELECT least($1, r_ready) FROM ' || v_own || 'depth()' INTO r_ready USING p_cap;
    SELECT k.r_id, k.r_deliveries INTO r_head_id, r_head_deliveries FROM {schema}.ring_rows_look(p_queue_id, 1) k;
END
$$;

CREATE OR REPLACE FUNCTION {schema}.ring_rows_rotate(p_queue_id integer, p_gen bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_ok boolean;
BEGIN
    PERFORM {schema}.ring_rows_groups_lock(p_queue_id);
    IF EXISTS (SELECT 1 FROM {schema}.ring_groups g WHERE g.queue_id = p_queue_id) THEN
        RETURN {schema}.ring_rows_rotate_groups(p_queue_id, p_gen);
    END IF;
    EXECUTE 'SELECT {schema}.ring_' || p_queue_id || '_rrotate($1)' INTO v_ok USING p_gen;
    RETURN v_ok;
END
$$;

CREATE OR REPLACE FUNCTION {schema}.ring_rows_label(p_queue_id integer, p_gen bigint) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    EXECUTE 'SELECT {schema}.ring_' || p_queue_id || '_rlabel($1)' USING p_gen;
END
$$;

-- The generation after the newest row's, when its segment is empty now (ring_rows_rotate), for
-- maintenance to label (ring_rows_label), ahead of the pushes that will need it; NULL while a lane still
-- needs that segment, or for a ring not of the rows layout.
CREATE OR REPLACE FUNCTION {schema}.ring_rows_rotate_ahead(p_queue_id integer) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_s bigint;
    v_last bigint;
BEGIN
    SELECT seg_rows INTO v_s FROM {schema}.ring_rows WHERE queue_id = p_queue_id;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    EXECUTE format('SELECT coalesce(pg_sequence_last_value(%L), 0)', '{schema}.ring_' || p_queue_id || '_rrows')
        INTO v_last;
    IF {schema}.ring_rows_rotate(p_queue_id, v_last / v_s + 1) THEN
        RETURN v_last / v_s + 1;
    END IF;
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION {schema}.ring_rows_gaps(
    p_queue_id integer, p_xmax bigint, p_last bigint, OUT r_xmax bigint, OUT r_last bigint, OUT r_skipped integer)
LANGUAGE plpgsql AS $$
DECLARE
    v_n integer;
    g record;
BEGIN
    -- The look takes a transaction id for its proof, so its transaction writes a commit record; it need
    -- not wait for that record's flush (synchronous_commit off, for this transaction only). What a crash
    -- could lose is harmless: lane positions past rows never written (a later look gives them up again),
    -- and the id itself (ids issued again after the crash only delay the proof against it; every push
    -- that held a row this look saw issued ended with the crash). A later commit that waits flushes this
    -- one first.
    PERFORM set_config('synchronous_commit', 'off', true);
    EXECUTE 'SELECT * FROM {schema}.ring_' || p_queue_id || '_rgaps($1, $2)'
        INTO r_xmax, r_last, r_skipped USING p_xmax, p_last;
    -- Every other group's lanes pass the same gaps (the proof is the ring's, not a group's); the rows
    -- given up are counted as the most any group gave up (each group passes each gap once).
    FOR g IN SELECT x.gid FROM {schema}.ring_groups x WHERE x.queue_id = p_queue_id ORDER BY x.gid DESC LOOP
        EXECUTE 'SELECT r_skipped FROM {schema}.' || {schema}.ring_rows_own(g.gid) || 'gaps($1, $2)'
            INTO v_n USING p_xmax, p_last;
        r_skipped := greatest(r_skipped, v_n);
    END LOOP;
END
$$;

-- The stats of p_queue_id (a ring's queue_id or a group's gid), as its own depth() counts them, in one
-- snapshot. A ring made by a build whose depth() counted neither expiry nor its pushes has r_expired,
-- r_lapsed and r_pushed NULL (the columns its depth() lacks, found by name). r_blocked: on a ring ordered
-- per key, the part of r_ready that waits behind a lane a pop may not take now (its depth() says which),
-- NULL on other rings and on a ring made by a build that did not count it.
CREATE OR REPLACE FUNCTION {schema}.ring_rows_tally(
    p_queue_id integer, OUT r_ready bigint, OUT r_delayed bigint, OUT r_in_flight bigint, OUT r_failed bigint,
    OUT r_oldest timestamptz, OUT r_rows bigint, OUT r_gens bigint[], OUT r_expired bigint, OUT r_lapsed bigint,
    OUT r_pushed bigint, OUT r_blocked bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_fn text := '{schema}.' || {schema}.ring_rows_own(p_queue_id) || 'depth';
    v_args text[] := (SELECT p.proargnames FROM pg_catalog.pg_proc p WHERE p.oid = to_regprocedure(v_fn || '()'));
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtext('dbqueue.rows.drop.{schema}'), p_queue_id);  -- before any of its objects: ring_rows_drop
    EXECUTE 'SELECT r_ready, r_delayed, r_in_flight, r_failed, r_oldest, r_rows, r_gens, '
        || CASE WHEN 'r_expired' = ANY (v_args) THEN 'r_expired, r_lapsed' ELSE 'NULL::bigint, NULL::bigint' END
        || ', ' || CASE WHEN 'r_pushed' = ANY (v_args) THEN 'r_pushed' ELSE 'NULL::bigint' END
        || ', ' || CASE WHEN 'r_blocked' = ANY (v_args) THEN 'r_blocked' ELSE 'NULL::bigint' END
        || ' FROM ' || v_fn || '()'
        INTO r_ready, r_delayed, r_in_flight, r_failed, r_oldest, r_rows, r_gens, r_expired, r_lapsed, r_pushed,
             r_blocked;
END
$$;

-- ring_rows_tally without r_blocked, for the client of the release before, which reads these columns.
CREATE OR REPLACE FUNCTION {schema}.ring_rows_counts(
    p_queue_id integer, OUT r_ready bigint, OUT r_delayed bigint, OUT r_in_flight bigint, OUT r_failed bigint,
    OUT r_oldest timestamptz, OUT r_rows bigint, OUT r_gens bigint[], OUT r_expired bigint, OUT r_lapsed bigint,
    OUT r_pushed bigint)
LANGUAGE sql AS $$
SELECT t.r_ready, t.r_delayed, t.r_in_flight, t.r_failed, t.r_oldest, t.r_rows, t.r_gens, t.r_expired,
       t.r_lapsed, t.r_pushed
FROM {schema}.ring_rows_tally(p_queue_id) t
$$;
