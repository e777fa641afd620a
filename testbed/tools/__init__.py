"""Around the testbed, not part of a run: provisioning a machine with Ansible
(``provision``), the throwaway VM with a stock kernel where the netem backend runs
(``vm``, driven by hand through ``vmcli``), and the pytest plugin that gives any project's
tests a lab that is up (``pytest_plugin``: the ``lab`` fixture, the ``network`` marker, the
skip where a machine cannot build one and the check that nothing was left behind)."""
