-- One read of a session (agent_sessions.backend: Want) in one CALL: the row, and the messages, steers,
-- queue and accepted keys it asks for as JSON arrays beside it, all one SELECT (one snapshot), and then
-- COMMIT, so the pooled connection is left with no transaction open (and needs no ROLLBACK when it goes
-- back to its pool). p_keys: a JSON array of the keys asked about, or NULL. JSON_ARRAYAGG is cut at
-- group_concat_max_len on MariaDB (1 MB by default): lifted for the call and put back.
CREATE PROCEDURE agent_sessions_read(IN p_session VARBINARY(1020), IN p_start INT, IN p_stop INT, IN p_last INT,
                                     IN p_steers BOOLEAN, IN p_queue BOOLEAN, IN p_keys LONGTEXT CHARACTER SET utf8mb4)
READS SQL DATA
BEGIN
  DECLARE v_len BIGINT UNSIGNED DEFAULT @@SESSION.group_concat_max_len;
  DECLARE EXIT HANDLER FOR SQLEXCEPTION
  BEGIN
    ROLLBACK;
    SET SESSION group_concat_max_len = v_len;
    RESIGNAL;
  END;
  SET SESSION group_concat_max_len = 4294967295;
  SELECT s.*, UNIX_TIMESTAMP() + MICROSECOND(NOW(6)) / 1e6 AS now_,
    CASE WHEN s.start_ IS NOT NULL THEN (SELECT JSON_ARRAYAGG(m.body ORDER BY m.idx) FROM agent_messages AS m
      WHERE m.session_id = s.session_id AND m.idx >= s.start_ AND m.idx < s.stop_) END AS messages_,
    CASE WHEN p_steers AND s.steers > 0 THEN (SELECT JSON_ARRAYAGG(JSON_ARRAY(t.id, t.body,
      CONVERT(t.steer_key USING utf8mb4)) ORDER BY t.id) FROM agent_steers AS t WHERE t.session_id = s.session_id)
      END AS steers_,
    CASE WHEN p_queue AND s.queued > 0 THEN (SELECT JSON_ARRAYAGG(JSON_ARRAY(q.id, CONVERT(q.queue_key USING utf8mb4),
      q.body) ORDER BY q.id) FROM agent_queue AS q WHERE q.session_id = s.session_id) END AS queue_,
    CASE WHEN p_keys IS NOT NULL THEN (SELECT JSON_ARRAYAGG(CONVERT(k.accepted_key USING utf8mb4))
      FROM agent_keys AS k WHERE k.session_id = s.session_id AND k.accepted_key IN (SELECT CAST(j.k AS BINARY)
      FROM JSON_TABLE(p_keys, '$[*]' COLUMNS (k VARCHAR(1280) CHARACTER SET utf8mb4 PATH '$')) AS j)) END AS keys_
  FROM (SELECT a.*, CASE WHEN p_start IS NOT NULL OR p_last IS NOT NULL THEN COALESCE(p_start,
          GREATEST(LEAST(COALESCE(p_stop, a.length), a.length) - p_last, 0)) END AS start_,
        LEAST(COALESCE(p_stop, a.length), a.length) AS stop_
        FROM agent_sessions AS a WHERE a.session_id = p_session) AS s;
  COMMIT;
  SET SESSION group_concat_max_len = v_len;
END
