from dataprep.cli import main

raise SystemExit(main())
