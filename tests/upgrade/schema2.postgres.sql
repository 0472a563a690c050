CREATE TABLE agent_sessions (
	session_id VARCHAR(255) NOT NULL, 
	version VARCHAR(32), 
	journal TEXT, 
	token VARCHAR(64), 
	host VARCHAR(255), 
	pid INTEGER, 
	expires DOUBLE PRECISION, 
	epoch BIGINT DEFAULT 0 NOT NULL, 
	cancelled BOOLEAN DEFAULT false NOT NULL, 
	PRIMARY KEY (session_id)
);

CREATE TABLE agent_messages (
	session_id VARCHAR(255) NOT NULL, 
	seq INTEGER NOT NULL, 
	body TEXT NOT NULL, 
	PRIMARY KEY (session_id, seq)
);

CREATE TABLE agent_steers (
	id BIGSERIAL NOT NULL, 
	session_id VARCHAR(255) NOT NULL, 
	text TEXT NOT NULL, 
	PRIMARY KEY (id)
);

CREATE INDEX agent_steers_by_session ON agent_steers (session_id, id);
