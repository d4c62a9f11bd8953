-- Migration 12: the engine's catalogue of what it created in its schema (owned_objects), so that
-- uninstall drops only that. install() fills it after this migration: for an install made before it,
-- with the objects of the engine's schema files found here (by kind and name), and with the schema
-- itself when nothing else is in it (older versions created it with CREATE SCHEMA IF NOT EXISTS, so
-- nothing else says who made it).

-- name: migrate
CREATE TABLE {schema}.owned_objects (
    kind text NOT NULL,
    name text NOT NULL,
    CONSTRAINT owned_objects_pkey PRIMARY KEY (kind, name)
);
