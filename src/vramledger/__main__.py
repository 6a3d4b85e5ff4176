from vramledger.cli import main

raise SystemExit(main())
