CREATE TABLE agent_sessions (
	session_id VARBINARY(1020) NOT NULL, 
	version VARCHAR(32), 
	journal LONGTEXT, 
	token VARCHAR(64), 
	host VARCHAR(255), 
	pid INTEGER, 
	expires DOUBLE, 
	epoch BIGINT NOT NULL DEFAULT 0, 
	cancelled BOOL NOT NULL DEFAULT false, 
	PRIMARY KEY (session_id)
)ENGINE=InnoDB CHARSET=utf8mb4 COLLATE utf8mb4_bin;

CREATE TABLE agent_messages (
	session_id VARBINARY(1020) NOT NULL, 
	seq INTEGER NOT NULL, 
	body LONGTEXT NOT NULL, 
	PRIMARY KEY (session_id, seq)
)ENGINE=InnoDB CHARSET=utf8mb4 COLLATE utf8mb4_bin;

CREATE TABLE agent_steers (
	id BIGINT NOT NULL AUTO_INCREMENT, 
	session_id VARBINARY(1020) NOT NULL, 
	text LONGTEXT NOT NULL, 
	PRIMARY KEY (id)
)ENGINE=InnoDB CHARSET=utf8mb4 COLLATE utf8mb4_bin;

CREATE INDEX agent_steers_by_session ON agent_steers (session_id, id);
