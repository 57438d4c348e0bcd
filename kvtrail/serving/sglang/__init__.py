"""kvtrail's SGLang plugin: records audit events from a real SGLang 0.5.23 deployment through its hook registry.

Nothing here is imported by the rest of kvtrail; SGLang's ``load_plugins()`` finds
:func:`kvtrail.serving.sglang.plugin.register` through the ``sglang.srt.plugins`` entry point.
"""
