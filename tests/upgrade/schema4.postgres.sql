CREATE TABLE IF NOT EXISTS agent_sessions (
	session_id VARCHAR(255) NOT NULL, 
	version VARCHAR(32), 
	journal TEXT, 
	token VARCHAR(64), 
	host VARCHAR(255), 
	pid INTEGER, 
	expires DOUBLE PRECISION, 
	epoch BIGINT DEFAULT 0 NOT NULL, 
	cancelled BOOLEAN DEFAULT false NOT NULL, 
	created DOUBLE PRECISION DEFAULT CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION) NOT NULL, 
	updated DOUBLE PRECISION DEFAULT CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION) NOT NULL, 
	metadata TEXT, 
	event_seq BIGINT, 
	PRIMARY KEY (session_id)
);

CREATE INDEX IF NOT EXISTS agent_sessions_by_updated ON agent_sessions (updated, session_id);

CREATE TABLE IF NOT EXISTS agent_messages (
	session_id VARCHAR(255) NOT NULL, 
	seq INTEGER NOT NULL, 
	body TEXT NOT NULL, 
	PRIMARY KEY (session_id, seq)
);

CREATE TABLE IF NOT EXISTS agent_steers (
	id BIGSERIAL NOT NULL, 
	session_id VARCHAR(255) NOT NULL, 
	text TEXT NOT NULL, 
	PRIMARY KEY (id)
);

CREATE INDEX IF NOT EXISTS agent_steers_by_session ON agent_steers (session_id, id);

CREATE TABLE IF NOT EXISTS agent_session_tags (
	session_id VARCHAR(255) NOT NULL, 
	name VARCHAR(64) NOT NULL, 
	value VARCHAR(255) NOT NULL, 
	PRIMARY KEY (session_id, name)
);

CREATE INDEX IF NOT EXISTS agent_session_tags_by_value ON agent_session_tags (name, value, session_id);

CREATE TABLE IF NOT EXISTS agent_events (
	session_id VARCHAR(255) NOT NULL, 
	seq BIGINT NOT NULL, 
	body TEXT NOT NULL, 
	PRIMARY KEY (session_id, seq)
);

CREATE TABLE IF NOT EXISTS agent_steer_keys (
	session_id VARCHAR(255) NOT NULL, 
	steer_key VARCHAR(255) NOT NULL, 
	PRIMARY KEY (session_id, steer_key)
);
