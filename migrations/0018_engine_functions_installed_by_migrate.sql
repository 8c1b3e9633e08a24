-- 0018: from here on, migrations hold tables, indexes, types and data only. Each engine function
-- has one file in worker/src/store/functions/, holding its current text; `migrate` installs
-- them all after the migrations, in the same transaction, and records here the hash of the set
-- it installed (and a digest of the functions as the server printed them then). `run` refuses a
-- schema whose record is missing or not its binary's, or whose functions changed since.
-- Template: `{{schema}}` is the deployment's schema (see 0001).

CREATE TABLE {{schema}}.wh_schema_functions (
  singleton      boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
  hash           text        NOT NULL,
  catalog_digest text        NOT NULL,
  installed_by   text        NOT NULL,
  installed_at   timestamptz NOT NULL DEFAULT now()
);
