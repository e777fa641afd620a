"""What a user writes, validated: topologies (``topology``), experiments (``experiment``),
the measured AWS matrix they may come from (``awsmatrix``), the model's shape without torch
(``modelshape``), pipeline schedules as data (``schedules``) and where the shipped
topologies, experiments and playbooks are found (``shipped``).  Nothing here builds or runs
anything; every other part of the testbed reads these specs."""
