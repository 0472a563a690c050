CREATE TABLE IF NOT EXISTS agent_sessions (
	session_id VARBINARY(1020) NOT NULL, 
	version VARCHAR(32), 
	journal LONGTEXT, 
	token VARCHAR(64), 
	host VARCHAR(255), 
	pid INTEGER, 
	expires DOUBLE, 
	epoch BIGINT NOT NULL DEFAULT 0, 
	cancelled BOOL NOT NULL DEFAULT false, 
	created DOUBLE NOT NULL DEFAULT (UNIX_TIMESTAMP() + MICROSECOND(NOW(6)) / 1000000.0), 
	updated DOUBLE NOT NULL DEFAULT (UNIX_TIMESTAMP() + MICROSECOND(NOW(6)) / 1000000.0), 
	metadata LONGTEXT, 
	event_seq BIGINT, 
	PRIMARY KEY (session_id), 
	INDEX agent_sessions_by_updated (updated, session_id)
)ENGINE=InnoDB CHARSET=utf8mb4 COLLATE utf8mb4_bin;

CREATE TABLE IF NOT EXISTS agent_messages (
	session_id VARBINARY(1020) NOT NULL, 
	seq INTEGER NOT NULL, 
	body LONGTEXT NOT NULL, 
	PRIMARY KEY (session_id, seq)
)ENGINE=InnoDB CHARSET=utf8mb4 COLLATE utf8mb4_bin;

CREATE TABLE IF NOT EXISTS agent_steers (
	id BIGINT NOT NULL AUTO_INCREMENT, 
	session_id VARBINARY(1020) NOT NULL, 
	text LONGTEXT NOT NULL, 
	PRIMARY KEY (id), 
	INDEX agent_steers_by_session (session_id, id)
)ENGINE=InnoDB CHARSET=utf8mb4 COLLATE utf8mb4_bin;

CREATE TABLE IF NOT EXISTS agent_session_tags (
	session_id VARBINARY(1020) NOT NULL, 
	name VARCHAR(64) NOT NULL, 
	value VARCHAR(255) NOT NULL, 
	PRIMARY KEY (session_id, name), 
	INDEX agent_session_tags_by_value (name, value, session_id)
)ENGINE=InnoDB CHARSET=utf8mb4 COLLATE utf8mb4_bin;

CREATE TABLE IF NOT EXISTS agent_events (
	session_id VARBINARY(1020) NOT NULL, 
	seq BIGINT NOT NULL, 
	body LONGTEXT NOT NULL, 
	PRIMARY KEY (session_id, seq)
)ENGINE=InnoDB CHARSET=utf8mb4 COLLATE utf8mb4_bin;

CREATE TABLE IF NOT EXISTS agent_steer_keys (
	session_id VARBINARY(1020) NOT NULL, 
	steer_key VARBINARY(1020) NOT NULL, 
	PRIMARY KEY (session_id, steer_key)
)ENGINE=InnoDB CHARSET=utf8mb4 COLLATE utf8mb4_bin;
