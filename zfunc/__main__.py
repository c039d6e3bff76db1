from zfunc.cli import main

raise SystemExit(main())
