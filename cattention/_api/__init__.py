"""The public functions, one module per family of calls; each checks its
call once (``_prepare``), writes what it appends, then runs it."""
