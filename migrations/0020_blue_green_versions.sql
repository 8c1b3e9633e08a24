-- Blue/green versions (DESIGN §12.6).

-- The definition (the perspective's config as JSON text, handlers in file order) each compiled
-- perspective was compiled from: while the next version of a blue/green perspective is built
-- beside it, the config holds the next version, and the live one is compiled from this.
ALTER TABLE {{schema}}.wh_perspectives ADD COLUMN definition text;

-- The versions of blue/green perspectives: the live one (once a version was built beside it),
-- the one being built (at most one per perspective) and those kept for a rollback. A version
-- that is not live is the perspective `<name>__v<version>` in cursors, work rows, subscriptions,
-- jobs and dead letters, and its tables are in its home schema `<schema>_<name>_v<version>`.
CREATE TABLE {{schema}}.wh_perspective_versions (
  perspective_name text        NOT NULL,
  version          integer     NOT NULL,
  state            text        NOT NULL CHECK (state IN ('live', 'building', 'kept')),
  definition       text        NOT NULL,
  -- Its tables, views and sequences, once known (moved by a switch); NULL for a version that
  -- was built in place: a switch then archives the live tables named like the next version's.
  relations        text[],
  created_at       timestamptz NOT NULL DEFAULT now(),
  -- When it last became live or stopped being live (NULL: never live).
  switched_at      timestamptz,
  PRIMARY KEY (perspective_name, version)
);
CREATE UNIQUE INDEX wh_perspective_versions_one_building
  ON {{schema}}.wh_perspective_versions (perspective_name) WHERE state = 'building';

-- A backfill that keeps the perspective's cursors: a kept version catching up for a rollback
-- applies only the events after its cursors.
ALTER TABLE {{schema}}.wh_perspective_jobs
  ADD COLUMN keep_cursors boolean NOT NULL DEFAULT false;
