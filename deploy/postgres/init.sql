-- Run once by the postgres image when it initialises an empty data volume (docker-entrypoint-initdb.d),
-- as POSTGRES_USER in POSTGRES_DB (fs3_meta, the namespace's database). mgmtd keeps its state in a
-- database of its own: both engines name their tables fs3_kv and fs3_info.
CREATE DATABASE fs3_mgmtd;
