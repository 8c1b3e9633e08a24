{#- A perspective's apply function: drop overloads of an older shape, then CREATE OR REPLACE.
    Slots: schema, function, tag (a dollar quote not in body), body (apply_body.sql). #}
{% set args = "uuid, bigint[], uuid[], bigint[], boolean, boolean, boolean, double precision, double precision, boolean, boolean, boolean, timestamp with time zone" %}
{% set result = "o_applied integer, o_last_version bigint, o_failed_work_id bigint, o_error text, o_done_work_ids bigint[], o_rewound boolean, o_completed_event_ids uuid[], o_applied_event_ids uuid[], o_contended_sqlstate text" %}
{% with name = function %}{% include "drop_older_overloads.sql" %}{% endwith %}
CREATE OR REPLACE FUNCTION {{ schema }}.{{ function }}(
    p_stream_id uuid, p_work_ids bigint[], p_event_ids uuid[], p_versions bigint[],
    p_instant boolean, p_debug boolean, p_force boolean,
    p_retry_base_ms double precision, p_retry_max_ms double precision,
    p_notify_applied boolean DEFAULT false, p_count_failure boolean DEFAULT false,
    p_contiguous boolean DEFAULT false, p_stop_at timestamptz DEFAULT NULL)
RETURNS TABLE ({{ result }})
LANGUAGE plpgsql
-- Handler SQL names its tables as `setup` created them; resolve them the same way whoever calls.
SET search_path TO {{ schema }}, public
AS {{ tag }}
{{ body }}{{ tag }}
