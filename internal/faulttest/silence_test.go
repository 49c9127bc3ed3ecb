package faulttest

import "github.com/Shopify/toxiproxy/v2/toxics"

// silence is toxiproxy's timeout toxic with no timeout, less its Cleanup:
// it drops every byte and keeps the connection. Removing a toxic with a
// Cleanup takes a path in toxiproxy (v2.5.0 to v2.12.0) that closes the
// removed stage without rewiring the stage before it, which then blocks
// for good on its next chunk (TestSilentLinkLeavesNoGoroutine); without
// one, removal rewires the chain as for any other toxic. (Setting the
// timeout toxic's toxicity to 0 instead is a data race in toxiproxy.)
type silence struct{}

func init() { toxics.Register("silence", new(silence)) }

// Pipe drops what comes in until the toxic is interrupted or the link
// closes.
func (silence) Pipe(stub *toxics.ToxicStub) {
	for {
		select {
		case <-stub.Interrupt:
			return
		case c := <-stub.Input:
			if c == nil {
				stub.Close()
				return
			}
		}
	}
}
