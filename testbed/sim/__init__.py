"""The simulator: ``build`` turns an experiment file into worker programs and links and a
simulated run into the same records a real run leaves; ``engine`` plays them out (a
discrete-event, fluid-network model); ``cli`` is ``testbed sim`` (one run or a sweep)."""
