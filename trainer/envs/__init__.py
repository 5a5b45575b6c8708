"""The environments ``inflight`` ships (``task.name``: ``arithmetic``, ``calculator``, ``reasoning_gym``, ...),
each written against the task API of ``inflight.trainer.tasks``, as a user's own would be."""
