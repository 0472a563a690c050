-- One read of a session (agent_sessions.backend: Want) in one CALL: five result sets, all of one snapshot
-- (a read-only transaction WITH CONSISTENT SNAPSHOT, committed at the end, so the pooled connection is left
-- with no transaction open and needs no ROLLBACK when it goes back to its pool): the row with the server's
-- clock and the index of the first message read (start_), then the messages asked for, the steers (when
-- p_steers), the queue (when p_queue), and which of p_keys (a JSON array, or NULL) were accepted. Rows, not
-- one JSON aggregate: a whole transcript may be larger than one packet (max_allowed_packet), each row not.
CREATE PROCEDURE agent_sessions_read(IN p_session VARBINARY(1020), IN p_start INT, IN p_stop INT, IN p_last INT,
                                     IN p_steers BOOLEAN, IN p_queue BOOLEAN, IN p_keys LONGTEXT CHARACTER SET utf8mb4)
READS SQL DATA
BEGIN
  DECLARE v_length, v_start, v_stop INT;
  DECLARE EXIT HANDLER FOR SQLEXCEPTION
  BEGIN
    ROLLBACK;
    RESIGNAL;
  END;
  SET TRANSACTION ISOLATION LEVEL REPEATABLE READ;
  START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY;
  SET v_length = (SELECT length FROM agent_sessions WHERE session_id = p_session);
  SET v_stop = LEAST(COALESCE(p_stop, v_length), v_length);
  IF p_start IS NOT NULL OR p_last IS NOT NULL THEN
    SET v_start = COALESCE(p_start, GREATEST(v_stop - p_last, 0));
  END IF;
  SELECT s.*, UNIX_TIMESTAMP() + MICROSECOND(NOW(6)) / 1e6 AS now_, v_start AS start_
    FROM agent_sessions AS s WHERE s.session_id = p_session;
  SELECT body FROM agent_messages
    WHERE session_id = p_session AND idx >= v_start AND idx < v_stop ORDER BY idx;
  SELECT id, body, steer_key FROM agent_steers WHERE p_steers AND session_id = p_session ORDER BY id;
  SELECT id, queue_key, body FROM agent_queue WHERE p_queue AND session_id = p_session ORDER BY id;
  SELECT accepted_key FROM agent_keys WHERE p_keys IS NOT NULL AND session_id = p_session
    AND accepted_key IN (SELECT CAST(j.k AS BINARY)
                         FROM JSON_TABLE(p_keys, '$[*]' COLUMNS (k VARCHAR(1280) CHARACTER SET utf8mb4 PATH '$')) AS j);
  COMMIT;
END
