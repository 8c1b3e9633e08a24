{#- ordering: eventId. Before a rewind's replay, the perspective's `reset` removes the stream's
    share of the model. Slots: reset (the statements). #}
    IF v_rewound THEN
{% for statement in reset %}
      {{ statement|indent(6) }};
{% endfor %}
    END IF;
