// Package helperproc runs the test binary again as one process of a
// fleet: tests that need several OS processes (separate clients, pools
// and runtimes on one Redis) start it with an environment that makes its
// TestMain play a helper, and read the JSON report it prints.
package helperproc

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
)

// Run runs the test binary with no test selected and env added to this
// process's environment, and decodes what it prints on stdout into
// report. A failed run's error carries its stderr.
func Run(env []string, report any) error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), env...)
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%v: %s", err, stderr.String())
	}
	return json.Unmarshal(out.Bytes(), report)
}
