"""The loader room: reads the files the decision core's objects are built from.

``routing/`` parses what it is given (a profiles document, an artefact's bytes) and
reads no file; this room does the reading and the writing: the step-time profiles
(``loaders.profiles``) and quality-predictor artefacts (``loaders.predictor``). It sits
beside ``state`` and ``sim``: the service rooms, offline tools, the CLI and benches import
it; ``routing`` and ``sim`` never do (they are handed what it read).
"""
