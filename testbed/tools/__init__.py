"""Around the testbed, not part of a run: provisioning a machine with Ansible
(``provision``) and the throwaway VM with a stock kernel where the netem backend runs
(``vm``, driven by hand through ``vmcli``)."""
