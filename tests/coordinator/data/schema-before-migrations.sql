-- The SQLite schema that Base.metadata.create_all made before migrations existed (gpuswarm at commit 841853a).
-- test_migrations upgrades a database made from it; never edit it.
CREATE TABLE nodes (
	id VARCHAR(16) NOT NULL, 
	public_key VARCHAR(64) NOT NULL, 
	resources JSON NOT NULL, 
	software_version VARCHAR(128) NOT NULL, 
	price_per_gpu_hour FLOAT NOT NULL, 
	endpoints JSON NOT NULL, 
	state VARCHAR(16) NOT NULL, 
	registered_at FLOAT NOT NULL, 
	last_seen FLOAT NOT NULL, 
	online BOOLEAN NOT NULL, 
	revoked BOOLEAN NOT NULL, 
	wg_public_key VARCHAR(44), 
	mesh_address VARCHAR(64), 
	mesh_endpoints JSON, 
	PRIMARY KEY (id), 
	UNIQUE (public_key)
);
CREATE TABLE mesh_ipam (
	id INTEGER NOT NULL, 
	state JSON NOT NULL, 
	PRIMARY KEY (id)
);
CREATE TABLE jobs (
	id VARCHAR(16) NOT NULL, 
	name VARCHAR(128) NOT NULL, 
	spec JSON NOT NULL, 
	state VARCHAR(16) NOT NULL, 
	created_at FLOAT NOT NULL, 
	started_at FLOAT, 
	finished_at FLOAT, 
	epoch FLOAT NOT NULL, 
	global_step INTEGER NOT NULL, 
	accuracy FLOAT, 
	loss FLOAT, 
	samples_per_second FLOAT NOT NULL, 
	peers INTEGER NOT NULL, 
	final_accuracy FLOAT, 
	failures INTEGER NOT NULL, 
	error TEXT, 
	PRIMARY KEY (id)
);
CREATE INDEX ix_jobs_state ON jobs (state);
CREATE TABLE seen_nonces (
	nonce VARCHAR(32) NOT NULL, 
	expires_at FLOAT NOT NULL, 
	PRIMARY KEY (nonce)
);
CREATE INDEX ix_seen_nonces_expires_at ON seen_nonces (expires_at);
CREATE TABLE assignments (
	id INTEGER NOT NULL, 
	job_id VARCHAR(16) NOT NULL, 
	node_id VARCHAR(16) NOT NULL, 
	state VARCHAR(16) NOT NULL, 
	shard_index INTEGER NOT NULL, 
	num_shards INTEGER NOT NULL, 
	created_at FLOAT NOT NULL, 
	ended_at FLOAT, 
	reason TEXT, 
	PRIMARY KEY (id), 
	FOREIGN KEY(job_id) REFERENCES jobs (id), 
	FOREIGN KEY(node_id) REFERENCES nodes (id)
);
CREATE INDEX ix_assignments_job_id ON assignments (job_id);
CREATE INDEX ix_assignments_node_state ON assignments (node_id, state);
CREATE TABLE contributions (
	id INTEGER NOT NULL, 
	job_id VARCHAR(16) NOT NULL, 
	node_id VARCHAR(16) NOT NULL, 
	seq INTEGER NOT NULL, 
	samples INTEGER NOT NULL, 
	steps INTEGER NOT NULL, 
	compute_seconds FLOAT NOT NULL, 
	rounds_joined INTEGER NOT NULL, 
	window_start FLOAT NOT NULL, 
	window_end FLOAT NOT NULL, 
	received_at FLOAT NOT NULL, 
	envelope JSON NOT NULL, 
	PRIMARY KEY (id), 
	UNIQUE (job_id, node_id, seq), 
	FOREIGN KEY(job_id) REFERENCES jobs (id), 
	FOREIGN KEY(node_id) REFERENCES nodes (id)
);
CREATE INDEX ix_contributions_job_id ON contributions (job_id);
CREATE TABLE artifacts (
	id INTEGER NOT NULL, 
	job_id VARCHAR(16) NOT NULL, 
	name VARCHAR(64) NOT NULL, 
	node_id VARCHAR(16) NOT NULL, 
	sha256 VARCHAR(64) NOT NULL, 
	size INTEGER NOT NULL, 
	final BOOLEAN NOT NULL, 
	accuracy FLOAT, 
	created_at FLOAT NOT NULL, 
	PRIMARY KEY (id), 
	UNIQUE (job_id, name), 
	FOREIGN KEY(job_id) REFERENCES jobs (id), 
	FOREIGN KEY(node_id) REFERENCES nodes (id)
);
CREATE INDEX ix_artifacts_job_id ON artifacts (job_id);
CREATE TABLE job_events (
	id INTEGER NOT NULL, 
	job_id VARCHAR(16) NOT NULL, 
	at FLOAT NOT NULL, 
	message TEXT NOT NULL, 
	PRIMARY KEY (id), 
	FOREIGN KEY(job_id) REFERENCES jobs (id)
);
CREATE INDEX ix_job_events_job_id ON job_events (job_id);
