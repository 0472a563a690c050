CREATE TABLE agent_sessions (
	session_id VARBINARY(1020) NOT NULL, 
	version VARCHAR(32) NOT NULL, 
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

CREATE TABLE agent_runs (
	session_id VARBINARY(1020) NOT NULL, 
	host VARCHAR(255) NOT NULL, 
	pid INTEGER NOT NULL, 
	token VARCHAR(64) NOT NULL, 
	expires DOUBLE NOT NULL, 
	cancelled BOOL NOT NULL, 
	PRIMARY KEY (session_id)
)ENGINE=InnoDB CHARSET=utf8mb4 COLLATE utf8mb4_bin;

CREATE TABLE agent_journals (
	session_id VARBINARY(1020) NOT NULL, 
	body LONGTEXT NOT NULL, 
	PRIMARY KEY (session_id)
)ENGINE=InnoDB CHARSET=utf8mb4 COLLATE utf8mb4_bin;
