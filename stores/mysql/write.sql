-- One guarded write of a session (agent_sessions.backend: Guard, Change) in one CALL: the procedure is its
-- own transaction (START TRANSACTION ... COMMIT), so a write is one round trip. The guard and the change
-- are JSON objects (agent_sessions.backend: guard_json, change_json), as stores/postgres/write.sql reads
-- them: a field is there when it asks or changes something; a nullable value is a one-element array.
-- READ COMMITTED: InnoDB then takes no gap locks, so writers of sessions that share nothing never wait for
-- each other (a missing row locked at REPEATABLE READ locks the gap beside it). Deletes that would read
-- on past the session's last row into another session's are bounded by LIMIT (its count of rows).
-- Texts are compared as bytes (CAST ... AS BINARY): MariaDB's utf8mb4_bin pads ('a' = 'a ').
-- p_lock_wait: whole seconds the row's lock is waited for before error 1205 (innodb_lock_wait_timeout,
-- set for the call and put back). A deadlock (1213) has rolled everything back: the caller runs it again.
-- Which fields the guard and the change have is read once (gk, ck: their JSON_KEYS): each JSON_EXTRACT of
-- a field reads the document from its start, and the change carries the step's messages, so asking the
-- change for every field it might have read those messages a dozen times over.
-- Answers one row: row_, a JSON array of done_, present_ (is there a row), now_ and the row's short fields
-- (after, when done; in the order of backend.py's _WRITTEN), then the row's long texts, a column each.
CREATE PROCEDURE agent_sessions_write(IN p_session VARBINARY(1020), IN p_guard LONGTEXT CHARACTER SET utf8mb4,
                                      IN p_change LONGTEXT CHARACTER SET utf8mb4,
                                      IN p_incarnation VARCHAR(64) CHARACTER SET utf8mb4, IN p_lock_wait INT)
MODIFIES SQL DATA
BEGIN
  DECLARE g LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin DEFAULT p_guard;
  DECLARE c LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin DEFAULT p_change;
  DECLARE gk TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin DEFAULT JSON_KEYS(p_guard);
  DECLARE ck TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin DEFAULT JSON_KEYS(p_change);
  DECLARE v_lease LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
  DECLARE v_wait INT DEFAULT @@SESSION.innodb_lock_wait_timeout;
  DECLARE v_now DOUBLE;
  DECLARE present, ok, done BOOLEAN DEFAULT FALSE;
  DECLARE attempt, at, n INT DEFAULT 0;
  DECLARE v_seq BIGINT;
  DECLARE r_exists, r_cancelled, r_handed BOOLEAN;
  DECLARE r_incarnation, r_token VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
  DECLARE r_host VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
  DECLARE r_created, r_updated, r_expires, r_open_since DOUBLE;
  DECLARE r_version, r_edits, r_epoch, r_last_seq BIGINT;
  DECLARE r_length, r_pid, r_steers, r_queued INT;
  DECLARE r_spec, r_turn, r_cancelled_turn, r_journal, r_metadata LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
  DECLARE EXIT HANDLER FOR SQLEXCEPTION
  BEGIN
    ROLLBACK;
    SET SESSION innodb_lock_wait_timeout = v_wait;
    RESIGNAL;
  END;
  IF p_lock_wait IS NOT NULL THEN
    SET SESSION innodb_lock_wait_timeout = p_lock_wait;
  END IF;
  SET TRANSACTION ISOLATION LEVEL READ COMMITTED;
  START TRANSACTION;
  locking: LOOP
    SET attempt = attempt + 1;
    SET present = FALSE;
    SELECT TRUE, exists_, incarnation, created, updated, version, length, edits, token, epoch, expires, host, pid,
           spec, turn, cancelled, cancelled_turn, handed, journal, open_since, metadata, last_seq, steers, queued
      INTO present, r_exists, r_incarnation, r_created, r_updated, r_version, r_length, r_edits, r_token, r_epoch,
           r_expires, r_host, r_pid, r_spec, r_turn, r_cancelled, r_cancelled_turn, r_handed, r_journal,
           r_open_since, r_metadata, r_last_seq, r_steers, r_queued
      FROM agent_sessions WHERE session_id = p_session FOR UPDATE;
    SET v_now = UNIX_TIMESTAMP() + MICROSECOND(NOW(6)) / 1e6;
    IF NOT present THEN  -- the row as it would be made: guarded as if it were there
      SET r_exists = FALSE, r_incarnation = '', r_created = 0, r_updated = 0, r_version = 0, r_length = 0,
          r_edits = 0, r_token = NULL, r_epoch = 0, r_expires = 0, r_host = '', r_pid = 0, r_spec = NULL,
          r_turn = NULL, r_cancelled = FALSE, r_cancelled_turn = NULL, r_handed = FALSE, r_journal = NULL,
          r_open_since = NULL, r_metadata = '{}', r_last_seq = 0, r_steers = 0, r_queued = 0;
    END IF;
    -- the guard
    SET ok = (NOT JSON_CONTAINS(gk, '"exists"') OR r_exists = (JSON_UNQUOTE(JSON_EXTRACT(g, '$.exists')) = 'true'))
      AND (NOT JSON_CONTAINS(gk, '"incarnation"')
           OR CAST(r_incarnation AS BINARY) = CAST(JSON_UNQUOTE(JSON_EXTRACT(g, '$.incarnation')) AS BINARY))
      AND (NOT JSON_CONTAINS(gk, '"version"') OR r_version = CAST(JSON_EXTRACT(g, '$.version') AS SIGNED))
      AND (NOT JSON_CONTAINS(gk, '"length"') OR r_length = CAST(JSON_EXTRACT(g, '$.length') AS SIGNED))
      AND (NOT JSON_CONTAINS(gk, '"edits"') OR r_edits = CAST(JSON_EXTRACT(g, '$.edits') AS SIGNED))
      AND (NOT JSON_CONTAINS(gk, '"lease"')
           OR (CAST(r_token AS BINARY) <=> CAST(IF(JSON_TYPE(JSON_EXTRACT(g, '$.lease[0]')) = 'NULL', NULL,
                                                  JSON_UNQUOTE(JSON_EXTRACT(g, '$.lease[0]'))) AS BINARY)
               AND r_epoch = CAST(JSON_EXTRACT(g, '$.lease[1]') AS SIGNED)))
      AND (NOT JSON_CONTAINS(gk, '"lease_free"') OR r_token IS NULL OR r_expires <= v_now)
      AND (NOT JSON_CONTAINS(gk, '"lease_held"') OR r_token IS NOT NULL)
      AND (NOT JSON_CONTAINS(gk, '"not_cancelled"') OR NOT r_cancelled)
      AND (NOT JSON_CONTAINS(gk, '"no_steers"') OR r_steers = 0)
      AND (NOT JSON_CONTAINS(gk, '"journal"')
           OR CAST(r_journal AS BINARY) <=> CAST(IF(JSON_TYPE(JSON_EXTRACT(g, '$.journal[0]')) = 'NULL', NULL,
                                                  JSON_UNQUOTE(JSON_EXTRACT(g, '$.journal[0]'))) AS BINARY))
      AND (NOT JSON_CONTAINS(gk, '"no_queue"') OR r_queued = 0);
    IF ok AND JSON_CONTAINS(gk, '"steers"') THEN
      SET ok = (SELECT COUNT(*) FROM agent_steers WHERE session_id = p_session
                AND id IN (SELECT x.id FROM JSON_TABLE(g, '$.steers[*]' COLUMNS (id BIGINT PATH '$')) AS x))
             = (SELECT COUNT(DISTINCT x.id) FROM JSON_TABLE(g, '$.steers[*]' COLUMNS (id BIGINT PATH '$')) AS x);
    END IF;
    IF ok AND JSON_CONTAINS(gk, '"queue_head"') THEN
      SET ok = (SELECT MIN(id) FROM agent_queue WHERE session_id = p_session)
               <=> CAST(JSON_EXTRACT(g, '$.queue_head') AS SIGNED);
    END IF;
    IF ok AND JSON_CONTAINS(gk, '"key_absent"') THEN
      SET ok = NOT EXISTS (SELECT 1 FROM agent_keys WHERE session_id = p_session
                           AND accepted_key = CAST(JSON_UNQUOTE(JSON_EXTRACT(g, '$.key_absent')) AS BINARY));
    END IF;
    IF NOT ok OR c = '{}' THEN
      LEAVE locking;
    END IF;
    IF JSON_CONTAINS(ck, '"delete"') THEN
      IF present THEN
        DELETE FROM agent_messages WHERE session_id = p_session LIMIT r_length;
        DELETE FROM agent_steers WHERE session_id = p_session LIMIT r_steers;
        DELETE FROM agent_queue WHERE session_id = p_session LIMIT r_queued;
        SET n = (SELECT COUNT(*) FROM agent_keys WHERE session_id = p_session);
        DELETE FROM agent_keys WHERE session_id = p_session LIMIT n;
        SET n = (SELECT COUNT(*) FROM agent_events WHERE session_id = p_session);
        DELETE FROM agent_events WHERE session_id = p_session LIMIT n;
        SET n = (SELECT COUNT(*) FROM agent_metadata WHERE session_id = p_session);
        DELETE FROM agent_metadata WHERE session_id = p_session LIMIT n;
        DELETE FROM agent_sessions WHERE session_id = p_session;
      END IF;
      SET done = TRUE;
      LEAVE locking;
    END IF;
    IF present THEN
      SET done = TRUE;
      LEAVE locking;
    END IF;
    IF attempt >= 5 THEN
      SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'agent_sessions_write: the row of the session kept vanishing';
    END IF;
    -- No row: make it, then lock it (this one, or the one a concurrent write made first) and guard again.
    INSERT IGNORE INTO agent_sessions (session_id, exists_, incarnation, created, updated, version, length, edits,
      token, epoch, expires, host, pid, spec, turn, cancelled, cancelled_turn, handed, journal, open_since, metadata,
      last_seq, steers, queued)
      VALUES (p_session, FALSE, '', 0, 0, 0, 0, 0, NULL, 0, 0, '', 0, NULL, NULL, FALSE, NULL, FALSE, NULL, NULL, '{}',
              0, 0, 0);
  END LOOP;
  IF done AND present AND NOT JSON_CONTAINS(ck, '"delete"') THEN
    -- the change
    SET r_version = r_version + 1;
    IF JSON_CONTAINS(ck, '"exist"') THEN
      IF NOT r_exists THEN
        SET r_exists = TRUE, r_incarnation = p_incarnation, r_created = v_now;
      END IF;
      SET r_updated = GREATEST(r_updated, v_now);
    END IF;
    IF JSON_CONTAINS(ck, '"splice"') THEN
      SET at = CAST(JSON_EXTRACT(c, '$.splice[0]') AS SIGNED);
      IF at < r_length THEN
        SET n = r_length - at;
        DELETE FROM agent_messages WHERE session_id = p_session AND idx >= at LIMIT n;
      END IF;
      INSERT INTO agent_messages (session_id, idx, body)
        SELECT p_session, at + x.o - 1, x.t
        FROM JSON_TABLE(c, '$.splice[1][*]' COLUMNS (o FOR ORDINALITY,
                                                     t LONGTEXT CHARACTER SET utf8mb4 PATH '$')) AS x;
      SET r_length = at + JSON_LENGTH(c, '$.splice[1]');
      SET r_edits = r_edits + 1;
    END IF;
    IF JSON_CONTAINS(ck, '"take_steers"') THEN
      DELETE FROM agent_steers WHERE session_id = p_session
        AND id IN (SELECT x.id FROM JSON_TABLE(c, '$.take_steers[*]' COLUMNS (id BIGINT PATH '$')) AS x);
      SET r_steers = r_steers - ROW_COUNT();
    END IF;
    IF JSON_CONTAINS(ck, '"add_steer"') THEN
      INSERT INTO agent_steers (session_id, id, body, steer_key)
        VALUES (p_session, r_version, JSON_UNQUOTE(JSON_EXTRACT(c, '$.add_steer[0]')),
                IF(JSON_TYPE(JSON_EXTRACT(c, '$.add_steer[1]')) = 'NULL', NULL,
                   CAST(JSON_UNQUOTE(JSON_EXTRACT(c, '$.add_steer[1]')) AS BINARY)));
      SET r_steers = r_steers + 1;
    END IF;
    IF JSON_CONTAINS(ck, '"pop"') THEN
      DELETE FROM agent_queue WHERE session_id = p_session AND id = CAST(JSON_EXTRACT(c, '$.pop') AS SIGNED);
      SET r_queued = r_queued - ROW_COUNT();
    END IF;
    IF JSON_CONTAINS(ck, '"push"') THEN
      INSERT INTO agent_queue (session_id, id, queue_key, body)
        VALUES (p_session, r_version, CAST(JSON_UNQUOTE(JSON_EXTRACT(c, '$.push[0]')) AS BINARY),
                JSON_UNQUOTE(JSON_EXTRACT(c, '$.push[1]')));
      SET r_queued = r_queued + 1;
    END IF;
    IF JSON_CONTAINS(ck, '"drop_key"') THEN
      DELETE FROM agent_keys WHERE session_id = p_session
        AND accepted_key = CAST(JSON_UNQUOTE(JSON_EXTRACT(c, '$.drop_key')) AS BINARY);
    END IF;
    IF JSON_CONTAINS(ck, '"add_key"') THEN
      INSERT IGNORE INTO agent_keys (session_id, accepted_key)
        VALUES (p_session, CAST(JSON_UNQUOTE(JSON_EXTRACT(c, '$.add_key')) AS BINARY));
    END IF;
    IF JSON_CONTAINS(ck, '"journal"') THEN
      SET r_journal = IF(JSON_TYPE(JSON_EXTRACT(c, '$.journal[0]')) = 'NULL', NULL,
                         JSON_UNQUOTE(JSON_EXTRACT(c, '$.journal[0]')));
    END IF;
    IF JSON_CONTAINS(ck, '"lease"') THEN
      SET v_lease = JSON_EXTRACT(c, '$.lease');
      IF JSON_EXTRACT(v_lease, '$.acquire') IS NOT NULL THEN
        SET v_lease = JSON_EXTRACT(v_lease, '$.acquire');
        SET r_token = JSON_UNQUOTE(JSON_EXTRACT(v_lease, '$.token')), r_epoch = r_epoch + 1,
            r_expires = v_now + CAST(JSON_EXTRACT(v_lease, '$.ttl') AS DOUBLE),
            r_host = JSON_UNQUOTE(JSON_EXTRACT(v_lease, '$.host')),
            r_pid = CAST(JSON_EXTRACT(v_lease, '$.pid') AS SIGNED),
            r_spec = IF(JSON_TYPE(JSON_EXTRACT(v_lease, '$.spec')) = 'NULL', NULL,
                        JSON_UNQUOTE(JSON_EXTRACT(v_lease, '$.spec'))),
            r_turn = IF(JSON_TYPE(JSON_EXTRACT(v_lease, '$.turn')) = 'NULL', NULL,
                        JSON_UNQUOTE(JSON_EXTRACT(v_lease, '$.turn'))),
            r_handed = r_handed OR r_cancelled, r_cancelled = FALSE;
      ELSEIF JSON_EXTRACT(v_lease, '$.renew') IS NOT NULL THEN
        SET r_expires = v_now + CAST(JSON_EXTRACT(v_lease, '$.renew') AS DOUBLE);
      ELSEIF JSON_EXTRACT(v_lease, '$.release') IS NOT NULL THEN
        SET r_token = NULL, r_handed = r_handed OR r_cancelled, r_cancelled = FALSE;
      ELSEIF JSON_EXTRACT(v_lease, '$.cancel') IS NOT NULL THEN
        SET r_cancelled = TRUE, r_cancelled_turn = r_turn;
      END IF;
    END IF;
    IF JSON_CONTAINS(ck, '"turn"') THEN
      SET r_turn = IF(JSON_TYPE(JSON_EXTRACT(c, '$.turn[0]')) = 'NULL', NULL, JSON_UNQUOTE(JSON_EXTRACT(c, '$.turn[0]')));
    END IF;
    IF JSON_CONTAINS(ck, '"handed"') THEN
      SET r_handed = (JSON_UNQUOTE(JSON_EXTRACT(c, '$.handed')) = 'true');
    END IF;
    IF JSON_CONTAINS(ck, '"open"') THEN
      IF JSON_UNQUOTE(JSON_EXTRACT(c, '$.open')) = 'set' THEN
        SET r_open_since = COALESCE(r_open_since, v_now);
      ELSEIF JSON_UNQUOTE(JSON_EXTRACT(c, '$.open')) = 'clear' THEN
        SET r_open_since = NULL;
      END IF;
    END IF;
    IF JSON_CONTAINS(ck, '"metadata"') THEN
      SET r_metadata = JSON_UNQUOTE(JSON_EXTRACT(c, '$.metadata'));
      SET n = (SELECT COUNT(*) FROM agent_metadata WHERE session_id = p_session);
      DELETE FROM agent_metadata WHERE session_id = p_session LIMIT n;
      INSERT INTO agent_metadata (session_id, name, value)
        SELECT p_session, CAST(x.name AS BINARY), CAST(x.value AS BINARY)
        FROM JSON_TABLE(c, '$.meta_index[*]' COLUMNS (name LONGTEXT CHARACTER SET utf8mb4 PATH '$[0]',
                                                       value LONGTEXT CHARACTER SET utf8mb4 PATH '$[1]')) AS x;
    END IF;
    IF JSON_CONTAINS(ck, '"events"') THEN
      SET v_seq = IF(r_last_seq = 0, FLOOR(v_now * 1000000) - 1, r_last_seq);
      INSERT INTO agent_events (session_id, seq, body)
        SELECT p_session, v_seq + x.o, x.t
        FROM JSON_TABLE(c, '$.events[*]' COLUMNS (o FOR ORDINALITY, t LONGTEXT CHARACTER SET utf8mb4 PATH '$')) AS x;
      SET r_last_seq = v_seq + JSON_LENGTH(c, '$.events');
      IF CAST(JSON_EXTRACT(c, '$.keep') AS SIGNED) > 0 THEN  -- the newest keep stay (0: every one)
        DELETE FROM agent_events WHERE session_id = p_session
          AND seq <= r_last_seq - CAST(JSON_EXTRACT(c, '$.keep') AS SIGNED);
      END IF;
    END IF;
    UPDATE agent_sessions SET
      exists_ = r_exists, incarnation = r_incarnation, created = r_created, updated = r_updated,
      version = r_version, length = r_length, edits = r_edits, token = r_token, epoch = r_epoch,
      expires = r_expires, host = r_host, pid = r_pid, spec = r_spec, turn = r_turn, cancelled = r_cancelled,
      cancelled_turn = r_cancelled_turn, handed = r_handed, journal = r_journal, open_since = r_open_since,
      metadata = r_metadata, last_seq = r_last_seq, steers = r_steers, queued = r_queued
    WHERE session_id = p_session;
  END IF;
  COMMIT;
  SET SESSION innodb_lock_wait_timeout = v_wait;
  SELECT JSON_ARRAY(ok OR done, present, v_now, r_exists, r_incarnation, r_created, r_updated, r_version, r_length,
                    r_edits, r_token, r_epoch, r_expires, r_host, r_pid, r_cancelled, r_handed, r_open_since,
                    r_last_seq, r_steers, r_queued) AS row_,
         r_spec AS spec, r_turn AS turn, r_cancelled_turn AS cancelled_turn, r_journal AS journal,
         r_metadata AS metadata;
END
