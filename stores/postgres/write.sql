-- One guarded write of a session (agent_sessions.backend: Guard, Change), in one call: the store runs
-- SELECT agent_sessions_write(...) in autocommit, so a write is one round trip and one transaction.
-- The guard and the change are JSON objects (agent_sessions.backend: guard_json, change_json): a field is there
-- when it asks or changes something; a nullable value the change sets, or the guard compares, is a
-- one-element array ([null]: none). The change's metadata comes with "meta_index", its (name, value)
-- pairs as Python indexes them (agent_sessions.backend.meta_index), so JSON is never rewritten here.
-- p_lock_wait: seconds the call waits for the row's lock (another transaction holds it) before it fails
-- with lock_not_available; NULL: the server's lock_timeout.
-- Returns {"done": bool, "now": seconds, "row": the row after (done) or as it stands, or null: no row}.
CREATE OR REPLACE FUNCTION agent_sessions_write(p_session text, p_guard jsonb, p_change jsonb,
                                                p_incarnation text, p_lock_wait double precision DEFAULT NULL)
RETURNS jsonb
LANGUAGE plpgsql AS $agent_sessions_write$
DECLARE
  r agent_sessions;
  c jsonb := p_change;
  g jsonb := p_guard;
  v_now double precision := extract(epoch FROM clock_timestamp());
  present boolean;
  ok boolean;
  at integer;
  n integer;
  v_seq bigint;
  lease jsonb;
BEGIN
  IF p_lock_wait IS NOT NULL THEN
    PERFORM set_config('lock_timeout', round(p_lock_wait * 1000) || 'ms', true);
  END IF;
  FOR attempt IN 1..5 LOOP
    SELECT * INTO r FROM agent_sessions WHERE session_id = p_session FOR UPDATE;
    present := FOUND;
    IF NOT present THEN  -- the row as it would be made: guarded as if it were there
      r.session_id := p_session; r.exists_ := false; r.incarnation := ''; r.created := 0; r.updated := 0;
      r.version := 0; r.length := 0; r.edits := 0; r.token := NULL; r.epoch := 0; r.expires := 0;
      r.host := ''; r.pid := 0; r.spec := NULL; r.turn := NULL; r.cancelled := false;
      r.cancelled_turn := NULL; r.handed := false; r.journal := NULL; r.open_since := NULL;
      r.metadata := '{}'; r.last_seq := 0; r.steers := 0; r.queued := 0;
    END IF;
    -- the guard
    ok := (NOT g ? 'exists' OR r.exists_ = (g->>'exists')::boolean)
      AND (NOT g ? 'incarnation' OR r.incarnation = g->>'incarnation')
      AND (NOT g ? 'version' OR r.version = (g->>'version')::bigint)
      AND (NOT g ? 'length' OR r.length = (g->>'length')::bigint)
      AND (NOT g ? 'edits' OR r.edits = (g->>'edits')::bigint)
      AND (NOT g ? 'lease' OR (r.token IS NOT DISTINCT FROM g->'lease'->>0
                               AND r.epoch = (g->'lease'->>1)::bigint))
      AND (NOT g ? 'lease_free' OR r.token IS NULL OR r.expires <= v_now)
      AND (NOT g ? 'lease_held' OR r.token IS NOT NULL)
      AND (NOT g ? 'not_cancelled' OR NOT r.cancelled)
      AND (NOT g ? 'no_steers' OR r.steers = 0)
      AND (NOT g ? 'journal' OR r.journal IS NOT DISTINCT FROM g->'journal'->>0)
      AND (NOT g ? 'no_queue' OR r.queued = 0);
    IF ok AND g ? 'steers' THEN
      ok := (SELECT count(*) FROM agent_steers WHERE session_id = p_session
             AND id IN (SELECT x::bigint FROM jsonb_array_elements_text(g->'steers') AS x))
            = (SELECT count(DISTINCT x) FROM jsonb_array_elements_text(g->'steers') AS x);
    END IF;
    IF ok AND g ? 'queue_head' THEN
      ok := (SELECT id FROM agent_queue WHERE session_id = p_session ORDER BY id LIMIT 1)
            IS NOT DISTINCT FROM (g->>'queue_head')::bigint;
    END IF;
    IF ok AND g ? 'key_absent' THEN
      ok := NOT EXISTS (SELECT 1 FROM agent_keys WHERE session_id = p_session AND accepted_key = g->>'key_absent');
    END IF;
    IF NOT ok OR c = '{}' THEN
      RETURN jsonb_build_object('done', ok, 'now', v_now, 'row', CASE WHEN present THEN to_jsonb(r) END);
    END IF;
    IF c ? 'delete' THEN
      IF present THEN
        DELETE FROM agent_messages WHERE session_id = p_session;
        DELETE FROM agent_steers WHERE session_id = p_session;
        DELETE FROM agent_queue WHERE session_id = p_session;
        DELETE FROM agent_keys WHERE session_id = p_session;
        DELETE FROM agent_events WHERE session_id = p_session;
        DELETE FROM agent_metadata WHERE session_id = p_session;
        DELETE FROM agent_sessions WHERE session_id = p_session;
      END IF;
      RETURN jsonb_build_object('done', true, 'now', v_now, 'row', CASE WHEN present THEN to_jsonb(r) END);
    END IF;
    EXIT WHEN present;
    -- No row: make it, then lock it (this one, or the one a concurrent write made first) and guard again.
    INSERT INTO agent_sessions SELECT r.* ON CONFLICT (session_id) DO NOTHING;
  END LOOP;
  IF NOT present THEN
    RAISE EXCEPTION USING MESSAGE = 'agent_sessions_write: the row of session ' || p_session || ' kept vanishing';
  END IF;
  -- the change
  r.version := r.version + 1;
  IF c ? 'exist' THEN
    IF NOT r.exists_ THEN
      r.exists_ := true; r.incarnation := p_incarnation; r.created := v_now;
    END IF;
    r.updated := greatest(r.updated, v_now);
  END IF;
  IF c ? 'splice' THEN
    at := (c->'splice'->>0)::integer;
    IF at < r.length THEN
      DELETE FROM agent_messages WHERE session_id = p_session AND idx >= at;
    END IF;
    INSERT INTO agent_messages (session_id, idx, body)
      SELECT p_session, at + o - 1, t FROM jsonb_array_elements_text(c->'splice'->1) WITH ORDINALITY AS x(t, o);
    r.length := at + jsonb_array_length(c->'splice'->1);
    r.edits := r.edits + 1;
  END IF;
  IF c ? 'take_steers' THEN
    DELETE FROM agent_steers WHERE session_id = p_session
      AND id IN (SELECT x::bigint FROM jsonb_array_elements_text(c->'take_steers') AS x);
    GET DIAGNOSTICS n = ROW_COUNT;
    r.steers := r.steers - n;
  END IF;
  IF c ? 'add_steer' THEN
    INSERT INTO agent_steers (session_id, id, body, steer_key)
      VALUES (p_session, r.version, c->'add_steer'->>0, c->'add_steer'->>1);
    r.steers := r.steers + 1;
  END IF;
  IF c ? 'push' THEN
    INSERT INTO agent_queue (session_id, id, queue_key, body)
      VALUES (p_session, r.version, c->'push'->>0, c->'push'->>1);
    r.queued := r.queued + 1;
  END IF;
  IF c ? 'pop' THEN
    DELETE FROM agent_queue WHERE session_id = p_session AND id = (c->>'pop')::bigint;
    GET DIAGNOSTICS n = ROW_COUNT;
    r.queued := r.queued - n;
  END IF;
  IF c ? 'add_key' THEN
    INSERT INTO agent_keys (session_id, accepted_key) VALUES (p_session, c->>'add_key') ON CONFLICT DO NOTHING;
  END IF;
  IF c ? 'drop_key' THEN
    DELETE FROM agent_keys WHERE session_id = p_session AND accepted_key = c->>'drop_key';
  END IF;
  IF c ? 'journal' THEN
    r.journal := c->'journal'->>0;
  END IF;
  lease := c->'lease';
  IF lease ? 'acquire' THEN
    lease := lease->'acquire';
    r.token := lease->>'token'; r.epoch := r.epoch + 1; r.expires := v_now + (lease->>'ttl')::double precision;
    r.host := lease->>'host'; r.pid := (lease->>'pid')::integer; r.spec := lease->>'spec'; r.turn := lease->>'turn';
    r.handed := r.handed OR r.cancelled; r.cancelled := false;
  ELSIF lease ? 'renew' THEN
    r.expires := v_now + (lease->>'renew')::double precision;
  ELSIF lease ? 'release' THEN
    r.token := NULL; r.handed := r.handed OR r.cancelled; r.cancelled := false;
  ELSIF lease ? 'cancel' THEN
    r.cancelled := true; r.cancelled_turn := r.turn;
    -- delivered when this commits, to the processes watching (stores/postgres/listener.py)
    PERFORM pg_notify('agent_cancels', r.epoch || ' ' || p_session);
  END IF;
  IF c ? 'turn' THEN
    r.turn := c->'turn'->>0;
  END IF;
  IF c ? 'handed' THEN
    r.handed := (c->>'handed')::boolean;
  END IF;
  IF c->>'open' = 'set' THEN
    r.open_since := coalesce(r.open_since, v_now);
  ELSIF c->>'open' = 'clear' THEN
    r.open_since := NULL;
  END IF;
  IF c ? 'metadata' THEN
    r.metadata := c->>'metadata';
    DELETE FROM agent_metadata WHERE session_id = p_session;
    INSERT INTO agent_metadata (session_id, name, value)
      SELECT p_session, x->>0, x->>1 FROM jsonb_array_elements(c->'meta_index') AS x;
  END IF;
  IF c ? 'events' THEN
    v_seq := CASE WHEN r.last_seq = 0 THEN floor(v_now * 1000000)::bigint - 1 ELSE r.last_seq END;
    INSERT INTO agent_events (session_id, seq, body)
      SELECT p_session, v_seq + o, t FROM jsonb_array_elements_text(c->'events') WITH ORDINALITY AS x(t, o);
    r.last_seq := v_seq + jsonb_array_length(c->'events');
    IF (c->>'keep')::bigint > 0 THEN  -- the newest keep stay (0: every one, as the memory store keeps them)
      DELETE FROM agent_events WHERE session_id = p_session AND seq <= r.last_seq - (c->>'keep')::bigint;
    END IF;
    -- Followers hold the advisory lock FOLLOWED shared while they listen (listener.py): when this write
    -- can take it, nobody listens, and it holds it to its commit, so a follower starting meanwhile
    -- listens only after that and then reads what this wrote.
    IF NOT pg_try_advisory_xact_lock(7018690069353821811) THEN
      PERFORM pg_notify('agent_events', p_session);
    END IF;
  END IF;
  UPDATE agent_sessions SET
    exists_ = r.exists_, incarnation = r.incarnation, created = r.created, updated = r.updated,
    version = r.version, length = r.length, edits = r.edits, token = r.token, epoch = r.epoch,
    expires = r.expires, host = r.host, pid = r.pid, spec = r.spec, turn = r.turn, cancelled = r.cancelled,
    cancelled_turn = r.cancelled_turn, handed = r.handed, journal = r.journal, open_since = r.open_since,
    metadata = r.metadata, last_seq = r.last_seq, steers = r.steers, queued = r.queued
  WHERE session_id = p_session;
  RETURN jsonb_build_object('done', true, 'now', v_now, 'row', to_jsonb(r));
END
$agent_sessions_write$;
