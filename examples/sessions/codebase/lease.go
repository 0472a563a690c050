package lease

import (
	"errors"
	"time"
)

var ErrLeaseExpired = errors.New("lease expired")

type Lease struct {
	Holder  string
	Expires time.Time
}

// renewLease extends a lease that is still live. An expired lease cannot be renewed:
// the caller must acquire a new one.
func renewLease(l *Lease, now time.Time, ttl time.Duration) (*Lease, error) {
	if l == nil {
		return nil, errors.New("no lease")
	}
	if now.After(l.Expires) {
		return nil, ErrLeaseExpired
	}
	return &Lease{Holder: l.Holder, Expires: now.Add(ttl)}, nil
}
