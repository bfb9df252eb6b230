"""What a process of a job knows about its own life, below everything that runs in it: the phase
it is in and how a failure is reported (``failure``), the stop signals (``signals``), which start
of the job it is (``attempts``), and the fork server its ranks and simulations start from
(``forkserver``, ``preloaded``)."""
