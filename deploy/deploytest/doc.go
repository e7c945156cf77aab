// Package deploytest checks Baton's deployment files against the code they deploy. It has
// no code of its own, only tests:
//
//   - deploy/postgres/roles.sql is applied to a real database and each role is shown to do
//     exactly its job: the app sends with the real producer and cannot touch queue fields,
//     the relay streams with the real relay, the worker runs real turns (polling) end to end,
//     and each is refused what it does not need (SQLSTATE 42501).
//   - docker-compose.yml, deploy/Dockerfile and deploy/kubernetes are parsed and every
//     command, flag and BATON_* variable in them is checked against what the built programs
//     accept (baton help, echoagent -h).
//   - deploy/prometheus and deploy/grafana are parsed and every metric they query is checked
//     against the metrics relay and consumer register.
package deploytest
