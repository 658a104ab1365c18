"""The Ray Serve application: speculation units, their request router, the OpenAI ingress.

Request path: HTTP → :mod:`.ingress` (FastAPI) → a :mod:`.unit` replica chosen by
:mod:`.request_router` (prefix affinity, least load) → its engine loop (:mod:`.engine_loop`)
driving the engine, whose target is the unit's target group (:mod:`.target_group`) and whose
proposer, for a draft model, its draft group (:mod:`.draft_group`).
"""
