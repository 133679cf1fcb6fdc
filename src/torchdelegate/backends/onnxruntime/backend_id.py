"""The id this backend's delegates are filed under, ``"onnxruntime"``: the partitioner tags for it and the
backend registers under it (the entry point ``torchdelegate.backends`` names it too).

Its own module, beneath both, so that the partitioner names the backend it tags for without importing
the backend's class (which imports the partitioner to propose it).
"""

BACKEND_ID = "onnxruntime"
