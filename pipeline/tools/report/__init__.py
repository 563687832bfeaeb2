"""``docbeam report``: one self-contained HTML page about a run, and its comparison with a baseline run.

command.py is the command (and imports Beam); args.py its arguments, which the CLI's parser reads without
importing the rest; load.py loads a run, data.py analyses it, charts.py draws it and page.py lays out the page.
This file imports none of them, so importing args.py costs nothing more.
"""
